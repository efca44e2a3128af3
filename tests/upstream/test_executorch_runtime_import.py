"""upstream/executorch_runtime_import.py: a process that only runs programs imports ExecuTorch's
runtime without its export stack. Fails when the pinned wheel stops allowing it."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from genai_pipeline.runtime.session import DecoderSession

CHILD = """
import json, sys
from genai_pipeline.runtime.session import DecoderSession
session = DecoderSession(sys.argv[1])
logits = session.prefill(list(range(1, 20)))
loaded = {m: m in sys.modules for m in ("executorch.exir", "torch._inductor", "sympy", "torchao")}
import executorch.exir, executorch.extension.llm.custom_ops.custom_ops  # export still works after
from genai_pipeline.upstream.executorch_runtime_import import import_executorch_runtime
print(json.dumps({"lean": import_executorch_runtime(), "loaded": loaded, "logits": logits.tolist(),
                  "exir": executorch.exir.ExecutorchProgramManager.__name__}))
"""


def test_programs_run_without_the_export_stack(export_tiny):
    folder = export_tiny("hybrid")
    done = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert child["lean"] and not any(child["loaded"].values()), child["loaded"]
    assert child["exir"] == "ExecutorchProgramManager"
    want = DecoderSession(folder).prefill(list(range(1, 20)))  # this process: the plain imports (pytest loaded exir)
    assert torch.equal(torch.tensor(child["logits"]), want)


def test_the_files_it_loads_by_path_are_the_pinned_wheels():
    import executorch

    root = Path(executorch.__path__[0])
    assert (root / "exir" / "_warnings.py").is_file()
    assert len(list((root / "extension" / "llm" / "custom_ops").glob("libcustom_ops_aot_lib.*"))) == 1
    # portable_lib needs nothing of exir but `_warnings` (a later version importing more would need the export stack)
    source = (root / "extension" / "pybindings" / "portable_lib.py").read_text()
    assert [line for line in source.splitlines() if "import" in line and "exir" in line] == [
        "import executorch.exir._warnings as _exir_warnings"
    ]


def test_another_executorch_imports_the_runtime_with_its_export_stack():
    code = (
        "import sys; from genai_pipeline.upstream import pins; pins.installed = lambda package: '1.6.0'; "
        "from genai_pipeline.upstream.executorch_runtime_import import import_executorch_runtime as i; "
        "print(i(), 'executorch.exir' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True"]
