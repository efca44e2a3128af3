"""upstream/executorch_logs.py: the pinned wheel's C++ runtime logs to file descriptor 2 when a method
loads, has no log-level setting, and `native_logs_hidden` keeps those lines off the terminal."""

import os
import subprocess
import sys

import torch
from conftest import REPO
from pretend_installed import pretend_installed

CHILD = """
import contextlib, sys
from genai_pipeline.upstream.executorch_runtime_import import import_executorch_runtime
from genai_pipeline.upstream.executorch_logs import native_logs_hidden
import_executorch_runtime()
from executorch.runtime import Runtime
with native_logs_hidden() if sys.argv[2] == "hidden" else contextlib.nullcontext():
    Runtime.get().load_program(sys.argv[1]).load_method("forward")
"""


def cpp_log_lines(program, how: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "GENAI_DEBUG"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(program), how],
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [line for line in done.stderr.splitlines() if line.startswith("[") and ".cpp:" in line]


def test_the_runtimes_logs_go_to_fd_2_and_are_hidden(tmp_path):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    program = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(1, 4),), strict=False)
    path = tmp_path / "linear.pte"
    path.write_bytes(to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)
    assert cpp_log_lines(path, "shown")  # e.g. "[cpuinfo_utils.cpp:71] Reading file ..."
    assert cpp_log_lines(path, "hidden") == []


def test_the_pinned_wheel_has_no_log_level_setting():
    # If a new wheel has one, use it instead of pointing fd 2 at /dev/null.
    from executorch.extension.pybindings import portable_lib
    from executorch.runtime import Runtime

    assert [n for n in dir(portable_lib) if "log" in n.lower() and n not in ("logger", "logging")] == []
    assert [n for n in dir(Runtime) if "log" in n.lower()] == []


def test_another_executorch_lets_them_through(monkeypatch, capfd):
    from genai_pipeline.upstream.executorch_logs import native_logs_hidden

    monkeypatch.delenv("GENAI_DEBUG", raising=False)
    with native_logs_hidden():
        os.write(2, b"[runtime.cpp:1] pinned\n")
    pretend_installed(monkeypatch, executorch="1.6.0")
    with native_logs_hidden():
        os.write(2, b"[runtime.cpp:1] another\n")
    err = capfd.readouterr().err
    assert "pinned" not in err and "[runtime.cpp:1] another" in err
