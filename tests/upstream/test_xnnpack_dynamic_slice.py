"""XNNPACK slices of dynamic-length tensors stay in their delegate (upstream/xnnpack_dynamic_slice.py):
fails when the pinned wheel stops serializing or running them the way the patch relies on."""

import pytest
import torch
from torch import nn
from torch.export import Dim


class FusedThenSplit(nn.Module):
    """A fused projection's output split along its last (static) dimension, as a decoder layer does."""

    def __init__(self):
        super().__init__()
        self.fused = nn.Linear(64, 96)
        self.out = nn.Linear(32, 16)

    def forward(self, x):
        y = self.fused(x)
        return self.out(y[..., :32] * y[..., 32:64] + y[..., -32:])


@pytest.fixture(scope="module")
def lowered():
    from executorch.exir import to_edge_transform_and_lower

    from genai_pipeline.targets import get_target
    from genai_pipeline.upstream.xnnpack_dynamic_slice import delegate_dynamic_slices

    torch.manual_seed(0)
    module = FusedThenSplit().eval()
    program = torch.export.export(
        module, (torch.randn(1, 7, 64),), dynamic_shapes=({1: Dim("length", min=1, max=128)},)
    )
    edge = to_edge_transform_and_lower(program, partitioner=get_target("xnnpack").partitioners())
    assert delegate_dynamic_slices()  # installed by the partitioners, for the pinned wheel
    ops = [str(n.target) for n in edge.exported_program().graph.nodes if n.op == "call_function"]
    return module, ops, edge.to_executorch().buffer


def test_slices_of_a_dynamic_length_tensor_stay_in_one_delegate(lowered):
    _, ops, _ = lowered
    assert sum("executorch_call_delegate" in op for op in ops) == 1, ops
    assert not [op for op in ops if "slice" in op], ops


@pytest.mark.parametrize("length", [1, 5, 7, 128])
def test_delegated_slices_take_each_call_length(lowered, length):
    """The slices' symbolic sizes are resolved per call by XNNPACK, against the eager module."""
    from executorch.runtime import Runtime

    module, _, program = lowered
    method = Runtime.get().load_program(program).load_method("forward")
    x = torch.randn(1, length, 64, generator=torch.Generator().manual_seed(length))
    got = method.execute([x])[0]
    assert got.shape == (1, length, 16)
    torch.testing.assert_close(got, module(x), rtol=1e-5, atol=1e-5)


def test_the_names_it_patches_are_the_pinned_wheels():
    import inspect

    from executorch.backends.xnnpack.operators.node_visitor import _node_visitor_dict
    from executorch.backends.xnnpack.partition.config.generic_node_configs import SliceCopyConfig
    from executorch.backends.xnnpack.utils.quant_utils import is_dequant
    from executorch.backends.xnnpack.utils.utils import PERM_NCHW_TO_NHWC

    visitor = _node_visitor_dict["aten.slice_copy.Tensor"]
    check, define = (getattr(f, "__wrapped__", f) for f in (SliceCopyConfig.check_constraints, visitor.define_node))
    assert list(inspect.signature(check).parameters) == ["self", "node", "ep"]
    assert list(inspect.signature(define).parameters) == ["self", "node", "xnn_graph", "vals_to_ids", "debug_handle"]
    assert callable(SliceCopyConfig.check_common_constraints) and callable(is_dequant) and len(PERM_NCHW_TO_NHWC) == 4


def test_patched_once_even_when_asked_again():
    from executorch.backends.xnnpack.operators.node_visitor import _node_visitor_dict
    from executorch.backends.xnnpack.partition.config.generic_node_configs import SliceCopyConfig

    from genai_pipeline.upstream.xnnpack_dynamic_slice import delegate_dynamic_slices

    assert delegate_dynamic_slices()
    patched = SliceCopyConfig.check_constraints, _node_visitor_dict["aten.slice_copy.Tensor"].define_node
    delegate_dynamic_slices.cache_clear()
    assert delegate_dynamic_slices()
    assert (SliceCopyConfig.check_constraints, _node_visitor_dict["aten.slice_copy.Tensor"].define_node) == patched
    assert all(not hasattr(f.__wrapped__, "__wrapped__") for f in patched)  # each wraps ExecuTorch's own
