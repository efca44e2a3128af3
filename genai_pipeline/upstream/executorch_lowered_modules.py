"""ExecuTorch's lowered delegate modules, their copies of the weights let go once serialized.

Upstream (executorch 1.5.1): `to_backend` keeps, in each `LoweredBackendModule` it inserts, the
partition's ExportedProgram (`original_module`) with the weights it was lowered from, for as long
as the program manager lives; the emitter reads only that program's graph (the debug handles of
its nodes and the number of its outputs, `exir/emit/_emitter.py`), and the delegate's payload and
named data already hold the weights as the backend serialized them.
What we change: `release_delegated_weights(edge)` replaces every lowered module's original weights
(its state_dict and constants) by stand-ins of one element expanded to their shapes, before the
program is emitted (the emit passes trace each delegate call with fake tensors made from them).
Why: until the program was written the eager quantized weights stayed resident beside their
serialized bytes: the emit stage's peak held both (a 3B model's 3.6 GB of int8 weights beside its
2 GB program). Freed only where nothing else holds them (a constant the program's own graph reads,
such as a tied embedding table, stays: its graph holds the tensor itself).
What breaks if upstream changes: `EdgeProgramManager.methods` / `exported_program(method)`,
`get_lowered_submodules`, `LoweredBackendModule.original_module` and the emitter reading only the
graph of it; tests/upstream/test_executorch_lowered_modules.py fails when the pinned wheel stops
allowing it (a program emitted after the release must be byte-identical). On another ExecuTorch
than the pinned one, nothing is released (logged once).
"""

from __future__ import annotations

import logging

import torch

from genai_pipeline.upstream import pins

log = logging.getLogger(__name__)


def release_delegated_weights(edge) -> int:
    """Each lowered module's original weights of `edge` (an EdgeProgramManager, after to_backend)
    replaced by one element expanded to their shapes and dtypes; returns how many were let go."""
    if not pins.warn_unpinned(log, "delegated weights kept until the program is written", "executorch"):
        return 0
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    released = 0
    for method in edge.methods:
        for _, lowered, _ in get_lowered_submodules(edge.exported_program(method).graph_module):
            program = lowered.original_module
            for tensors in (program.state_dict, program.constants):
                for name, t in tensors.items():
                    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > t.element_size():
                        # One element seen at every index: the emit passes trace the delegate call
                        # through these (in fake tensors, on the CPU), for shapes only.
                        stand_in = torch.zeros((), dtype=t.dtype).expand(t.shape)
                        tensors[name] = (
                            torch.nn.Parameter(stand_in, False) if isinstance(t, torch.nn.Parameter) else stand_in
                        )
                        released += 1
    return released
