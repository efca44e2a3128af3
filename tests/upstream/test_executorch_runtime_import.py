"""upstream/executorch_runtime_import.py: a process that only runs programs imports ExecuTorch's
runtime without its export stack. Fails when the pinned wheel stops allowing it."""

import json
import subprocess
import sys

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
