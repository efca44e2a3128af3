"""Every patch, fork or private use of torch, ExecuTorch and torchao internals, one module per thing
patched, each guarded by the versions in pins.py (docs/upstream-patches.md lists them all):

- pins.py: the pinned torch / ExecuTorch / torchao versions and the check every module here calls.
- exir_lowering.py: ExecuTorch's `to_edge_transform_and_lower`, re-tracing each graph once; `lower_grouped`
  (several methods in one payload: QNN context binaries).
- executorch_program_manager.py: the program re-serialized so that a delegate's named data equal to a
  constant of the program (a tied LM head's table) is stored once.
- executorch_logs.py: the C++ runtime's logs to fd 2 kept off the terminal (`native_logs_hidden`).
- executorch_runtime_import.py: ExecuTorch's runtime imported without its export stack.
- torch_export_caches.py: torch's and ExecuTorch's caches of the last lowering emptied once a program is written.
- xnnpack_preprocess.py: XNNPACK's preprocess sharing weights and skipping idle passes; `install()` once per process.
- xnnpack_weights_cache.py: XNNPACK's weights cache switched on through the runtime's C++ backend option.
- xnnpack_dynamic_slice.py: XNNPACK slices of dynamic-length tensors kept inside their delegate.

This package imports only torch, ExecuTorch, torchao and `genai_pipeline.errors`; anyone may use it.
"""
