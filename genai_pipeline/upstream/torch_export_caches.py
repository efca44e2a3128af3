"""Module-level caches of torch's export and ExecuTorch's lowering, emptied once a program is written.

Upstream (torch 2.13, executorch 1.5.1): state at module or class level keeps the last graphs of a
lowering reachable, and through their nodes' metadata the weights they were traced with: torch's
export keeps the nodes of its last trace for a leak check (`proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT`),
torch memoizes `ShapeEnv` methods, fake tensors' dispatch caches (`FakeTensorMode.cache_clear`, each
`ShapeEnv.fake_tensor_cache`) key on the arguments of the ops they ran, and ExecuTorch memoizes node
comparisons (`executorch.exir.backend.utils.is_same_node`) without bound.
What we change: `forget_lowered_graphs()` clears them; compile calls it after each program is written.
Why: a SmolLM2-135M 8da4w export held ~600 MB after its program was written; clearing costs nothing
but the next lowering's cache misses.
What breaks if upstream changes: any of those names renamed or gone. On another torch or ExecuTorch
than the pinned ones nothing is cleared (upstream's behaviour: more memory held, logged once);
tests/upstream/test_torch_export_caches.py fails when the pinned wheels stop having them, and
tests/targets/test_xnnpack.py::test_nothing_keeps_the_weights_once_the_program_is_written when
clearing them stops letting the weights go.
"""

from __future__ import annotations

import gc
import logging

from genai_pipeline.upstream import pins

log = logging.getLogger(__name__)


def forget_lowered_graphs() -> None:
    """Module-level state in torch and ExecuTorch keeps the last graphs of a lowering reachable, and
    through their nodes' metadata the weights they were traced with (a SmolLM2-135M 8da4w export
    held ~600 MB after its program was written): torch's export keeps the nodes of its last trace
    for a leak check, torch memoizes ShapeEnv methods (keeping each ShapeEnv, whose fake
    tensor cache holds the lowered modules), fake tensors' dispatch caches key on the arguments of
    the ops they ran, a delegate call's lowered module among them (the class-wide cache, and each
    ShapeEnv's: a garbage collection does not free a ShapeEnv whose only referrers are the symbolic
    sizes in its own cache's keys), and ExecuTorch memoizes node comparisons without bound.
    Clearing them costs nothing but the next lowering's cache misses."""
    if not pins.warn_unpinned(
        log, "torch's and ExecuTorch's caches of the last lowering kept (more memory held)", "torch", "executorch"
    ):
        return
    from executorch.exir.backend.utils import is_same_node
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental import proxy_tensor
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT.clear()
    FakeTensorMode.cache_clear()
    for shape_env in (o for o in gc.get_objects() if _is_a(o, ShapeEnv)):
        shape_env.fake_tensor_cache.clear()
    for method in vars(ShapeEnv).values():
        if hasattr(method, "cache_clear"):
            method.cache_clear()
    is_same_node.cache_clear()


def _is_a(obj, cls) -> bool:
    try:
        return isinstance(obj, cls)
    except ReferenceError:  # a weakref.proxy whose object has gone (gc.get_objects() lists them): not one
        return False
