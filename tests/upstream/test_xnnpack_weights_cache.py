"""The upstream behaviour `upstream/xnnpack_weights_cache.py` relies on, in the pinned wheel: the
mangled `set_option` / `get_option` exist in libexecutorch.so, the copied `BackendOption` layout is
what they read, and XNNPACK's backend keeps `weight_cache_enabled`. (Its effect on memory is
tests/runtime/test_packed_weights.py.)"""

import os
import subprocess
import sys

from conftest import REPO


def run(code: str, **env) -> str:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def test_the_pinned_wheel_reads_the_weights_cache_option_back():
    # A fresh process: the option is set once per process, before any program loads.
    code = "from genai_pipeline.upstream.xnnpack_weights_cache import share_packed_weights as s; print(s())"
    assert run(code) == "True"
    assert run(code, GENAI_XNNPACK_WEIGHT_CACHE="0") == "False"
    # Another ExecuTorch: its C++ layout is not known, the cache stays off.
    assert run(f"from genai_pipeline.upstream import pins; pins.installed = lambda package: '1.6.0'; {code}") == "False"


def test_the_wheel_ships_with_the_cache_off_and_the_copied_layout_reads_it():
    # Read without setting: the copied BackendOption layout decodes XNNPACK's answer as a bool, and
    # that bool is off. If a new wheel turns the cache on by default, this patch can go.
    code = """
import ctypes, os
from pathlib import Path
import executorch.extension.pybindings.portable_lib as p
from genai_pipeline.upstream.xnnpack_weights_cache import _BackendOption
lib = ctypes.CDLL(str(Path(p.__file__).parents[2] / "lib" / "libexecutorch.so"), mode=os.RTLD_NOLOAD)
f = lib._ZN10executorch7runtime10get_optionEPKcNS0_4SpanINS0_13BackendOptionEEE
f.restype, f.argtypes = ctypes.c_uint32, [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
o = _BackendOption(key=b"weight_cache_enabled", index=7)
o.value[0] = 9
print(f(b"XnnpackBackend", ctypes.addressof(o), 1), o.index, o.value[0])
"""
    assert run(code).split() == ["0", "0", "0"]  # no error, the bool alternative, false
