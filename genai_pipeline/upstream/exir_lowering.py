"""Lowering to ExecuTorch's edge dialect and a backend: ExecuTorch's own steps, re-tracing the
graph fewer times.

Upstream (executorch 1.5.1): `exir.to_edge_transform_and_lower` decomposes each exported graph three
times, and `_generate_edge_program` runs eight aten-to-edge passes, each a re-trace of the whole
graph with fake tensors (~0.5 s a layer with a symbolic sequence length), whether or not it has
anything to rewrite.
What we change: `to_edge_transform_and_lower` decomposes once when no partitioner refuses a node of
the ops it takes whole, and `edge_program` (a fork of `_generate_edge_program`) skips the passes
with nothing to rewrite in the graph; `lower_grouped` lowers each group of methods of a
`targets.GroupedLowering` (QNN context binaries) in one `to_backend` call.
Why: exports 1.3-1.5x faster; the programs come out byte for byte as ExecuTorch's own lowering
makes them (tests/upstream/test_exir_lowering.py, tests/targets/test_xnnpack.py).
What breaks if upstream changes: the private names imported below from
`executorch.exir.program._program`, `executorch.exir._program_utils`, `executorch.exir.tracer` and
`torch._export.passes`, the order and names of `_generate_edge_program`'s passes (`HAS_WORK`),
and what each pass rewrites. On another torch or ExecuTorch than the pinned ones,
`to_edge_transform_and_lower` is ExecuTorch's own (logged once) and `lower_grouped` stops with one
line naming the pinned version; tests/upstream/test_exir_lowering.py fails when the pinned wheels
stop behaving as assumed.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from genai_pipeline.upstream import pins

log = logging.getLogger(__name__)


def to_edge_transform_and_lower(programs: dict, partitioners: list, constant_methods: dict):
    """ExecuTorch's `to_edge_transform_and_lower`, re-tracing each graph once where it re-traces
    three times. It functionalizes a graph, decomposes it to core ATen but for the ops the
    partitioners take whole (`linear`, torchao's quantize ops, ...), then decomposes once more
    the nodes of those ops that a partitioner refuses. When no node is refused, one decomposition
    that keeps those ops does it all, and the export is 1.3-1.5x faster (SmolLM2-135M 8da4w:
    467 -> 304 s). The program is byte-identical for SmolLM2-135M and the test models; for
    Llama-3.2-1B one delegate numbers its values differently (550 bytes), logits bit-identical.
    When a node is refused, ExecuTorch's path takes over.
    (Named as ExecuTorch's: its partitioners take a caller of any other name for the deprecated
    `to_edge` + `to_backend` workflow and warn.)"""
    from executorch import exir

    if not pins.warn_unpinned(
        log, "lowering by ExecuTorch's own to_edge_transform_and_lower (slower)", "torch", "executorch"
    ):
        return exir.to_edge_transform_and_lower(
            programs,
            partitioner=partitioners,
            constant_methods=constant_methods,
            compile_config=exir.EdgeCompileConfig(_check_ir_validity=False),
        )
    from executorch.exir.program._program import (
        EdgeProgramManager,
        _remove_invalid_ops_for_not_decompose,
        _sanity_check_graph_for_non_decomp_ops,
    )
    from executorch.exir.tracer import _default_decomposition_table

    def wanted(program):  # [(ops a partitioner takes whole, which of their nodes it takes)], as ExecuTorch filters them
        return [
            (set(_remove_invalid_ops_for_not_decompose(ops)), supports)
            for ops, supports in (p.ops_to_not_decompose(program) for p in partitioners)
        ]

    keep = {op for program in programs.values() for ops, _ in wanted(program) for op in ops}
    table = _default_decomposition_table()
    for op in keep:
        table.pop(op, None)
    programs = {name: program.run_decompositions(table) for name, program in programs.items()}
    # The IR validity check re-traces every graph; skipping it is byte-identical and ~11 % faster.
    config = exir.EdgeCompileConfig(_check_ir_validity=False)
    refused = any(
        node.op == "call_function" and node.target in ops and supports is not None and not supports(node)
        for program in programs.values()
        for ops, supports in wanted(program)
        for node in program.graph.nodes
    )
    if refused:  # from the decomposed graphs: re-tracing the exported ones again trips on their unbacked symbols
        return exir.to_edge_transform_and_lower(
            programs, partitioner=partitioners, constant_methods=constant_methods, compile_config=config
        )
    config = dataclasses.replace(config, preserve_ops=sorted(keep, key=str))
    edge = EdgeProgramManager(
        {name: edge_program(config, program) for name, program in programs.items()},
        constant_methods,
        config,
    )
    for partitioner in partitioners:
        edge = edge.to_backend(partitioner)
    for method in edge.methods:  # as ExecuTorch: a node of an op kept whole is not left to the runtime
        program = edge.exported_program(method)
        for ops, supports in wanted(program):
            _sanity_check_graph_for_non_decomp_ops(method, program, ops, supports, generate_error=True)
    return edge


def edge_program(config, program):
    """ExecuTorch's `_generate_edge_program` (aten to edge dialect), minus the passes with nothing
    to rewrite in the graph. Eight of its passes re-trace the whole graph with fake tensors, ~0.5 s
    a layer each with a symbolic sequence length, and six of them find nothing to do in a decoder
    lowered to XNNPACK (it has no `aten.t`, no view op is left by then, no op mixes dtypes, RMSNorm's
    eps is a linear's bias rather than a float literal, ...)."""
    from executorch.exir._program_utils import _get_updated_graph_signature
    from executorch.exir.passes import convert_constant_dim_order_pass, remove_unused_parameters_pass
    from executorch.exir.program._program import _get_aten_to_edge_passes, _transform, lift_constant_tensor_pass
    from executorch.exir.verification.verifier import EXIREdgeDialectVerifier
    from torch.export import ExportedProgram

    program = remove_unused_parameters_pass(program)
    graph_module = program.graph_module
    for pass_ in aten_to_edge_passes(config):
        if may_rewrite(pass_, graph_module):  # decided on the graph the passes before it left
            graph_module = pass_(graph_module).graph_module
    edge_program = ExportedProgram(
        root=graph_module,
        graph=graph_module.graph,
        graph_signature=_get_updated_graph_signature(program.graph_signature, graph_module),
        state_dict=program.state_dict,
        range_constraints=program.range_constraints,
        module_call_graph=program.module_call_graph,
        example_inputs=program.example_inputs,
        constants=program.constants,
        verifiers=[
            EXIREdgeDialectVerifier(edge_compile_config=config, class_only=True, preserve_ops=config.preserve_ops)
        ],
    )
    edge_program = lift_constant_tensor_pass(edge_program)  # the tensors ScalarToTensorPass made
    edge_program = convert_constant_dim_order_pass.convert_constant_dim_order_pass(edge_program)
    return _transform(edge_program, *_get_aten_to_edge_passes(config)[1])


def aten_to_edge_passes(config) -> list:
    """The graph passes of `_generate_edge_program`, in its order."""
    from executorch.exir.passes import MemoryFormatOpsPass, OpReplacePass
    from executorch.exir.passes.remove_graph_asserts_pass import RemoveNonCoreAtenOpGraphAssertsPass
    from executorch.exir.program._program import _get_aten_to_edge_passes
    from torch._export.passes import ReplaceViewOpsWithViewCopyOpsPass

    passes = [
        RemoveNonCoreAtenOpGraphAssertsPass(),
        ReplaceViewOpsWithViewCopyOpsPass(),
        *_get_aten_to_edge_passes(config)[0],
        OpReplacePass(),
    ]
    return passes if config._skip_dim_order else [*passes, MemoryFormatOpsPass()]


def pass_name(pass_) -> str:
    return type(getattr(pass_, "__wrapped__", pass_)).__name__  # ExecuTorch's pass managers wrap them


def may_rewrite(pass_, graph_module) -> bool:
    """False for an aten-to-edge pass that would find nothing to rewrite in the graph (what each
    rewrites is in its `call_operator`); True for any other pass."""
    has_work = HAS_WORK.get(pass_name(pass_))
    if has_work is None:
        return True
    if any(isinstance(m, torch.fx.GraphModule) for m in graph_module.modules() if m is not graph_module):
        return True  # control flow: the pass also walks the branches' graphs
    return has_work(graph_module.graph)


def _operator_calls(graph) -> list:
    return [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]


def _tensor_arguments(node) -> list:
    """The values passed where the op's schema has a Tensor."""
    from executorch.exir.pass_base import map_args

    found = []
    map_args(
        node.target,
        lambda value, arg: found.append(value) if isinstance(arg.type, torch.TensorType) else None,
        node.args,
        node.kwargs,
    )
    return found


def _calls_transpose(graph) -> bool:  # NormalizeTransposePass
    return any(n.target == torch.ops.aten.t.default for n in _operator_calls(graph))


def _calls_a_view(graph) -> bool:  # ReplaceBrokenOpsWithFunctionalOpsPass
    return any(n.target.is_view for n in _operator_calls(graph))


def _passes_a_literal_as_tensor(graph) -> bool:  # ScalarToTensorPass
    return any(isinstance(v, (float, int, bool)) for n in _operator_calls(graph) for v in _tensor_arguments(n))


def _passes_a_symbol_as_tensor(graph) -> bool:  # SymToTensorPass
    return any(
        isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))
        for n in _operator_calls(graph)
        for v in _tensor_arguments(n)
    )


# Binary ops whose tensor operands RemoveMixedTypeOperators casts to the result's dtype.
_PROMOTING_OPS = (
    "aten.add.Tensor",
    "aten.mul.Tensor",
    "aten.sub.Tensor",
    "aten.div.Tensor",
    "aten.div.Tensor_mode",
    "aten.minimum.default",
)


def _mixes_dtypes(graph) -> bool:  # RemoveMixedTypeOperators: an operand whose dtype is not the result's
    for n in _operator_calls(graph):
        if str(n.target) in _PROMOTING_OPS and len(n.args) > 1:
            result = n.meta["val"].dtype
            for v in _tensor_arguments(n):
                if not isinstance(v, torch.fx.Node) or getattr(v.meta["val"], "dtype", result) != result:
                    return True
    return False


def _calls_a_memory_format_op(graph) -> bool:  # MemoryFormatOpsPass; it runs on edge ops, not OpOverloads
    from executorch.exir.dialects.edge._ops import EdgeOpOverload
    from executorch.exir.passes.dim_order_ops_registry import DimOrderOpsMap

    return any(isinstance(n.target, EdgeOpOverload) and n.target in DimOrderOpsMap for n in graph.nodes)


HAS_WORK = {
    "NormalizeTransposePass": _calls_transpose,
    "ReplaceBrokenOpsWithFunctionalOpsPass": _calls_a_view,
    "ScalarToTensorPass": _passes_a_literal_as_tensor,
    "SymToTensorPass": _passes_a_symbol_as_tensor,
    "RemoveMixedTypeOperators": _mixes_dtypes,
    "MemoryFormatOpsPass": _calls_a_memory_format_op,
}


def lower_grouped(programs: dict, grouped, constant_methods: dict):
    """Lowering for a backend whose one payload holds several graphs (a targets.GroupedLowering:
    QNN context binaries), by ExecuTorch's own steps as `to_edge_transform_and_lower_to_qnn`
    takes them (the backend's passes on each exported graph, the edge dialect keeping the ops
    its partitioner takes whole, its edge passes, then partitioning), except that each group of
    methods is partitioned in ONE `to_backend` call: the backend's `preprocess_multimethod`
    receives every method of the group together and returns one payload for all of them, and
    the emitter stores identical payloads once (keyed by sha256), so the group's methods
    reference one. Methods of different groups get payloads of their own. Then the target
    checks what was produced (compile specs, partition counts, shared payloads)."""
    pins.require_pinned("lowering several methods into one payload (QNN context binaries)", "executorch")
    from executorch import exir
    from executorch.exir.program._program import _gen_edge_manager_for_partitioners, lift_constant_tensor_pass

    specs = grouped.compile_specs
    with grouped.context({method: specs[method] for group in grouped.groups for method in group}):
        partitioners = {group: grouped.partitioner(specs[group[0]]) for group in grouped.groups}
        by_method = {method: [p] for group, p in partitioners.items() for method in group}
        programs = {name: grouped.export_transform(p) if name in by_method else p for name, p in programs.items()}
        passes = {method: grouped.edge_passes(programs[method], specs[method]) for method in by_method}
        config = exir.EdgeCompileConfig(_check_ir_validity=False)
        edge = _gen_edge_manager_for_partitioners(by_method, programs, config, constant_methods)
        if any(passes.values()):
            edge = edge.transform({method: p for method, p in passes.items() if p})
            for method in edge.methods:
                lift_constant_tensor_pass(edge.exported_program(method))
        for group, partitioner in partitioners.items():
            edge = edge.to_backend({method: partitioner for method in group})
    grouped.check(edge, specs)
    return edge
