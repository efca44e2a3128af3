"""XNNPACK slices of dynamic-length tensors, delegated.

The executorch 1.5.1 wheel's XNNPACK partitioner refuses any `slice_copy` whose input has a
symbolic dimension (`SliceCopyConfig`), and its serializer would write the dimension's upper bound
as the slice's size (`SliceCopyVisitor`). XNNPACK's static slice itself takes a size of 0, at offset
0, as "the whole dimension", resolved each time the delegate is reshaped to its inputs. So a slice
of a dynamic-length tensor along a static dimension (the split of a fused projection's output, the
halves of a head) can stay inside its delegate instead of ending it: each such slice otherwise
costs a portable copy and two delegate boundaries.

Here the config accepts such slices and the serializer writes 0 for their symbolic dimensions;
for the pinned version only (another version keeps ExecuTorch's own behaviour: correct, the slices
outside the delegates; logged once). tests/upstream/test_xnnpack_dynamic_slice.py fails when the
wheel stops working this way.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from genai_pipeline.upstream import pins

log = logging.getLogger(__name__)


def _static_dimension_slice(node) -> bool:
    """A stride-1 slice along a static dimension, of a tensor with no empty dimension."""
    value = node.args[0].meta["val"]
    dim = node.args[1] % value.dim()
    stride = node.args[4] if len(node.args) > 4 else 1
    return (
        stride == 1
        and is_concrete_int(value.shape[dim])
        and all(s != 0 for s in (*value.shape, *node.meta["val"].shape))
    )


@functools.cache
def delegate_dynamic_slices() -> bool:
    """Patch XNNPACK's slice config and serializer (once per process); True when patched."""
    if not pins.warn_unpinned(log, "XNNPACK slices of dynamic-length tensors left outside its delegates", "executorch"):
        return False
    from executorch.backends.xnnpack.operators.node_visitor import _node_visitor_dict
    from executorch.backends.xnnpack.partition.config.generic_node_configs import SliceCopyConfig
    from executorch.backends.xnnpack.utils.quant_utils import is_dequant
    from executorch.backends.xnnpack.utils.utils import PERM_NCHW_TO_NHWC

    visitor = _node_visitor_dict["aten.slice_copy.Tensor"]
    if SliceCopyConfig.check_constraints.__module__ == __name__:
        return True  # patched already (a cleared cache): the wrappers are never wrapped
    upstream_check = SliceCopyConfig.check_constraints
    upstream_define = visitor.define_node

    def check_constraints(self, node, ep) -> bool:
        shape = node.args[0].meta["val"].shape
        if all(is_concrete_int(s) for s in shape):
            return upstream_check(self, node, ep)
        # float slices only: a quantized one (dq -> slice -> q) keeps upstream's rule
        float_slice = node.args[0].meta["val"].dtype == torch.float32 and not is_dequant(node.args[0])
        return float_slice and self.check_common_constraints(node, ep) and _static_dimension_slice(node)

    def define_node(self, node, xnn_graph, vals_to_ids, debug_handle) -> None:
        upstream_define(self, node, xnn_graph, vals_to_ids, debug_handle)
        shape = list(node.meta["val"].shape)
        if "XNN_NHWC_NODE" in node.meta:
            shape = [shape[i] for i in PERM_NCHW_TO_NHWC]
        xnn_slice = xnn_graph.xnodes[-1].xnode_union
        xnn_slice.sizes = [size if is_concrete_int(s) else 0 for s, size in zip(shape, xnn_slice.sizes)]

    check_constraints.__wrapped__, define_node.__wrapped__ = upstream_check, upstream_define
    SliceCopyConfig.check_constraints = check_constraints
    visitor.define_node = define_node
    return True
