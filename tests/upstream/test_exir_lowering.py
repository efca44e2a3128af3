"""upstream/exir_lowering.py: ExecuTorch's steps re-tracing less, against ExecuTorch's own lowering,
and the private names of the pinned wheels it relies on. (That the decoder's programs are byte for
byte ExecuTorch's is in tests/targets/test_xnnpack.py.)"""

import dataclasses
import inspect

import pytest
import torch
from pretend_installed import pretend_installed

from genai_pipeline.errors import ExportError


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_the_private_names_it_uses_are_the_pinned_wheels():
    from executorch.exir import EdgeCompileConfig
    from executorch.exir._program_utils import _get_updated_graph_signature
    from executorch.exir.program import _program
    from executorch.exir.tracer import _default_decomposition_table
    from torch._export.passes import ReplaceViewOpsWithViewCopyOpsPass

    from genai_pipeline.upstream.exir_lowering import HAS_WORK, aten_to_edge_passes, pass_name

    assert parameters(_program._remove_invalid_ops_for_not_decompose) == ["preserve_ops"]
    assert parameters(_program._sanity_check_graph_for_non_decomp_ops)[:5] == [
        "name",
        "program",
        "ops_set_to_not_decompose",
        "check_op_support",
        "generate_error",
    ]
    assert parameters(_program._get_aten_to_edge_passes) == ["config"]
    before_lifting, after_lifting = _program._get_aten_to_edge_passes(EdgeCompileConfig())
    assert isinstance(before_lifting, list) and isinstance(after_lifting, list)
    assert parameters(_program._transform)[:2] == ["self", "passes"]
    assert parameters(_program._gen_edge_manager_for_partitioners)[:4] == [
        "partitioner",
        "aten_programs",
        "config",
        "constant_methods",
    ]
    assert callable(_program.lift_constant_tensor_pass) and callable(_program.EdgeProgramManager)
    assert parameters(_get_updated_graph_signature) == ["old_signature", "new_gm"]
    assert callable(_default_decomposition_table) and callable(ReplaceViewOpsWithViewCopyOpsPass)
    assert {f.name for f in dataclasses.fields(EdgeCompileConfig)} >= {
        "_check_ir_validity",
        "_skip_dim_order",
        "preserve_ops",
    }
    # Every pass `may_rewrite` may skip is one of `_generate_edge_program`'s, as `aten_to_edge_passes` lists them.
    assert set(HAS_WORK) <= {pass_name(p) for p in aten_to_edge_passes(EdgeCompileConfig())}


def test_another_version_lowers_by_executorchs_own_steps_or_stops_with_one_line(monkeypatch):
    from executorch import exir

    from genai_pipeline.upstream.exir_lowering import lower_grouped, to_edge_transform_and_lower

    pretend_installed(monkeypatch, executorch="1.6.0")
    called = []
    monkeypatch.setattr(
        exir, "to_edge_transform_and_lower", lambda programs, **kwargs: called.append(programs) or "ExecuTorch's"
    )
    assert to_edge_transform_and_lower({"forward": "exported"}, [], {}) == "ExecuTorch's"
    assert called == [{"forward": "exported"}]
    with pytest.raises(ExportError, match=r"executorch==1\.5\.1, found executorch 1\.6\.0"):
        lower_grouped({}, None, {})


def test_nodes_a_partitioner_refuses_are_decomposed_as_executorch_does(monkeypatch):
    """compile decomposes each graph once, keeping whole the ops a partitioner takes whole; where it
    refuses one of their nodes, ExecuTorch's own lowering takes over and decomposes that node."""
    from executorch import exir
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    from genai_pipeline.upstream.exir_lowering import to_edge_transform_and_lower as ours

    class RefusingTheSecondLinear(XnnpackPartitioner):
        def ops_to_not_decompose(self, program):
            ops, supports = super().ops_to_not_decompose(program)
            linears = [n for n in program.graph.nodes if "linear" in str(n.target)]
            return ops, lambda node: node not in linears[-1:] and supports(node)

    def programs():
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        return {"forward": torch.export.export(mlp, (torch.randn(2, 8),), strict=False)}

    theirs, took_over = exir.to_edge_transform_and_lower, []
    monkeypatch.setattr(exir, "to_edge_transform_and_lower", lambda *a, **k: took_over.append(1) or theirs(*a, **k))
    edge = ours(programs(), [RefusingTheSecondLinear()], {})
    assert took_over
    left = [str(n.target) for n in edge.exported_program().graph.nodes if n.op == "call_function"]
    assert not any("linear" in t for t in left)  # the refused linear was decomposed (and delegated as a matmul)
    executorchs = theirs(
        programs(),
        partitioner=[RefusingTheSecondLinear()],
        compile_config=exir.EdgeCompileConfig(_check_ir_validity=False),
    )
    assert edge.to_executorch().buffer == executorchs.to_executorch().buffer


def test_an_aten_to_edge_pass_is_skipped_only_where_it_has_nothing_to_rewrite():
    """compile runs an aten-to-edge pass only where `may_rewrite` says it has work. Over a graph
    that gives most of them work, every pass that changes the graph was said to, and the edge
    program equals ExecuTorch's."""
    from executorch import exir
    from executorch.exir.passes.normalize_transpose_pass import NormalizeTransposePass
    from executorch.exir.passes.replace_broken_ops_with_function_ops_pass import ReplaceBrokenOpsWithFunctionalOpsPass
    from executorch.exir.program._program import _generate_edge_program
    from executorch.exir.tracer import _default_decomposition_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from genai_pipeline.upstream.exir_lowering import aten_to_edge_passes, edge_program, may_rewrite, pass_name

    class MixedTypesScalarsAndCopies(torch.nn.Module):
        def forward(self, x, i):
            y = (x + i) * 2.0 + x.shape[0]  # int + float, a float literal, a symbolic size as an operand
            return (
                y.t(),
                y.to(torch.float16),
                x.clone(memory_format=torch.contiguous_format),
                torch.div(i, 2, rounding_mode="floor"),
            )

    def program():
        inputs = (torch.randn(4, 3), torch.arange(3))
        exported = torch.export.export(
            MixedTypesScalarsAndCopies(),
            inputs,
            dynamic_shapes=({0: torch.export.Dim("n", min=2, max=64)}, None),
            strict=False,
        )
        return exported.run_decompositions(_default_decomposition_table())

    config = exir.EdgeCompileConfig(_check_ir_validity=False)
    graph_module, changed = program().graph_module, set()
    for pass_ in aten_to_edge_passes(config):
        name, said, before = pass_name(pass_), may_rewrite(pass_, graph_module), graph_module.code
        graph_module = pass_(graph_module).graph_module
        if graph_module.code != before:
            assert said, f"{name} rewrote the graph, may_rewrite said it would not"
            changed.add(name)
    assert {"ScalarToTensorPass", "SymToTensorPass", "RemoveMixedTypeOperators", "MemoryFormatOpsPass"} <= changed
    assert (
        edge_program(config, program()).graph_module.code == _generate_edge_program(config, program()).graph_module.code
    )
    # The two that no exported graph gave work here (the view ops are copies by then), on graphs made to
    for pass_, work in (
        (NormalizeTransposePass(), lambda x: x.t() + 1),
        (ReplaceBrokenOpsWithFunctionalOpsPass(), lambda x: x.view(-1) + 1),
    ):
        for fn, has_work in ((work, True), (lambda x: x + 1, False)):
            graph_module = make_fx(fn, tracing_mode="fake")(torch.randn(3, 4))
            assert may_rewrite(pass_, graph_module) == has_work
            assert (pass_(graph_module).graph_module.code != graph_module.code) == has_work
