"""ExecuTorch's runtime imported without its export stack: ~130 MB less in every `genai run` / `bench`.

This patches around two imports of the executorch 1.5.1 wheel that only export needs:
- `executorch.extension.pybindings.portable_lib` imports `executorch.exir._warnings` for one warning
  class, and with it the package `executorch.exir` (the whole export stack: sympy, networkx, torchao);
- `executorch.extension.llm.custom_ops.custom_ops`, which loads the library holding the
  `llama::custom_sdpa` / `update_cache` kernels our programs call, also imports `torch._inductor`
  to register lowerings for export.
Here `exir/_warnings.py` is loaded on its own (under a placeholder for its package, removed after),
and the kernels' library by `torch.ops.load_library`, which is what custom_ops.py does first; a later
`import executorch.exir` or custom_ops.py in the same process loads them as usual. Only for the
pinned version and when nothing has imported exir yet; otherwise the plain imports.
tests/upstream/test_executorch_runtime_import.py fails when the wheel stops working this way.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys
import types
from pathlib import Path

from genai_pipeline.upstream import pins

log = logging.getLogger(__name__)


@functools.cache
def import_executorch_runtime() -> bool:
    """Register the runtime and the kernels our programs call; True when done without the export
    stack. Once per process, before anything else imports ExecuTorch's runtime."""
    lean = "executorch.exir" not in sys.modules and pins.warn_unpinned(
        log, "ExecuTorch's runtime imported with its export stack (~130 MB more)", "executorch"
    )
    if lean:
        try:
            _import_portable_lib_without_exir()
            _load_custom_ops_kernels()
        except Exception as e:  # noqa: BLE001  the wheel changed: the plain imports below
            log.debug("ExecuTorch's runtime imported with its export stack: %s", e)
            lean = False
    if not lean:
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  llama.update_cache / custom_sdpa kernels
    import executorch.kernels.quantized  # noqa: F401  quantized embedding kernels

    return lean


def _import_portable_lib_without_exir() -> None:
    import executorch

    exir = Path(executorch.__path__[0]) / "exir"
    placeholder = types.ModuleType("executorch.exir")
    placeholder.__path__ = [str(exir)]
    spec = importlib.util.spec_from_file_location("executorch.exir._warnings", exir / "_warnings.py")
    warnings_module = importlib.util.module_from_spec(spec)
    sys.modules["executorch.exir"] = placeholder
    sys.modules["executorch.exir._warnings"] = warnings_module
    try:
        spec.loader.exec_module(warnings_module)
        import executorch.extension.pybindings.portable_lib  # noqa: F401
    finally:
        del sys.modules["executorch.exir"]  # the real package loads on a later import
        if "executorch.extension.pybindings.portable_lib" not in sys.modules:
            del sys.modules["executorch.exir._warnings"]


def _load_custom_ops_kernels() -> None:
    import executorch
    import torch

    if not hasattr(torch.ops.llama, "custom_sdpa"):
        folder = Path(executorch.__path__[0]) / "extension" / "llm" / "custom_ops"
        (library,) = folder.glob("libcustom_ops_aot_lib.*")
        torch.ops.load_library(library)
