"""XNNPACK's weights cache, switched on from Python through the runtime's C++ backend options.

This patches around the executorch 1.5.1 wheel: it is built without ENABLE_XNNPACK_WEIGHTS_CACHE and
its Python API has no backend options, so the option is set with ctypes on libexecutorch.so's
`executorch::runtime::set_option`, whose `BackendOption` layout is copied below. Both the mangled
names and the layout belong to that version: any other version leaves the cache off (logged once), and
tests/upstream/test_xnnpack_weights_cache.py fails when the pinned wheel stops reading the option back.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

from genai_pipeline.upstream import pins

log = logging.getLogger(__name__)


class _BackendOption(ctypes.Structure):
    """executorch::runtime::BackendOption (runtime/backend/options.h): a 64-byte key, then
    std::variant<bool, int, std::array<char, 256>>: 256 bytes of storage, then its index byte."""

    _fields_ = [
        ("key", ctypes.c_char * 64),
        ("value", ctypes.c_ubyte * 256),
        ("index", ctypes.c_ubyte),
        ("_pad", ctypes.c_ubyte * 3),
    ]


_BOOL, _INT = 0, 1  # the variant's alternatives


@functools.cache
def share_packed_weights() -> bool:
    """Turn on XNNPACK's weights cache, once per process, before any program loads.

    XNNPACK packs each delegated weight into its kernels' layout when a method is loaded. Without
    the cache (the 1.5.1 wheel's default: built without ENABLE_XNNPACK_WEIGHTS_CACHE) every method
    packs its own copy, so a hybrid program, whose `prefill` and `decode_token` read the same weights
    (stored once in the file), holds them twice in memory. With it, packed weights are kept by the
    name the file stores them under (a hash of their bytes) and every delegate that names them
    shares one copy (docs/decisions/0009). The wheel's Python API has no backend options, so
    this calls the runtime's C++ `executorch::runtime::set_option("XnnpackBackend", ...)`, and
    reads the option back: a layout this code does not know leaves the default and logs why.
    (Workspace sharing, the other memory option, is already `Global` in this wheel.)
    GENAI_XNNPACK_WEIGHT_CACHE=0 leaves it off, for A/B measurements."""
    if os.environ.get("GENAI_XNNPACK_WEIGHT_CACHE") == "0":
        return False
    if not pins.warn_unpinned(
        log, "XNNPACK weights cache left off: its C++ layout is the pinned version's", "executorch"
    ):
        return False
    import executorch.extension.pybindings.portable_lib as portable_lib  # loads libexecutorch.so

    try:
        lib = ctypes.CDLL(str(Path(portable_lib.__file__).parents[2] / "lib" / "libexecutorch.so"), mode=os.RTLD_NOLOAD)
        set_option = lib._ZN10executorch7runtime10set_optionEPKcNS0_4SpanINS0_13BackendOptionEEE
        get_option = lib._ZN10executorch7runtime10get_optionEPKcNS0_4SpanINS0_13BackendOptionEEE
    except (OSError, AttributeError) as e:
        log.debug("XNNPACK weights cache left off: %s", e)
        return False
    for f in (set_option, get_option):  # Span<BackendOption> is passed by value: (data, size)
        f.restype, f.argtypes = ctypes.c_uint32, [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    option = _BackendOption(key=b"weight_cache_enabled", index=_BOOL)
    option.value[0] = 1
    error = set_option(b"XnnpackBackend", ctypes.addressof(option), 1)
    check = _BackendOption(key=b"weight_cache_enabled")
    error = error or get_option(b"XnnpackBackend", ctypes.addressof(check), 1)
    enabled = not error and check.index == _BOOL and check.value[0] == 1
    if not enabled:
        log.debug("XNNPACK weights cache left off (error %d, read back %d/%d)", error, check.index, check.value[0])
    return enabled
