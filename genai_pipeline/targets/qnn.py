"""Qualcomm QNN (HTP). ExecuTorch's QnnQuantizer annotates, calibrates and converts on any host,
and the compile specs are built, decoded and checked on any host too; only partitioning and
compiling context binaries need the QNN SDK's libraries (libQnnHtp.so), which only Qualcomm
distributes.

A hybrid program's `prefill_chunk` and `decode_token` are lowered together (one `preprocess_multimethod`
call): QNN compiles both graphs into ONE context binary with weight sharing, the program stores
it once and both methods reference it; at run time the backend picks the graph by method name.
Weight sharing across graphs needs HTP V73 or newer. QNN compiles a group of methods with the
first method's specs only, so every method of a group must carry identical specs (checked)."""

from __future__ import annotations

import dataclasses

from genai_pipeline.options import QnnOptions
from genai_pipeline.targets.qnn_specs import QnnPlan, check_lowered, compile_specs, plan, sdk_root, summary
from genai_pipeline.targets.target import GroupedLowering, Target
from genai_pipeline.upstream.qnn_internals import no_download, qnn_pass_manager

# QuantDtype names of ExecuTorch's Qualcomm quantizer, by our recipe names.
QUANT_DTYPES = {"16a8w": "use_16a8w", "16a4w": "use_16a4w", "16a4w_block": "use_16a4w_block", "8a8w": "use_8a8w"}


def _lowering_blocked() -> str | None:
    if sdk_root() is not None:
        return None
    return (
        "lowering to QNN needs the Qualcomm QNN SDK (QNN_SDK_ROOT pointing at a folder with "
        "lib/<arch>/libQnnHtp.so) and none is installed here; the calibrated QDQ model was saved and "
        "`genai eval` evaluates it"
    )


def share_cache_encodings(graph_module) -> None:
    """The decoder's cache-I/O form: the past keys/values entering attention's concatenation take
    the encodings of this call's rows beside them, the rows the graph returns and the runtime
    writes into the cache. Left to QnnQuantizer, each cache input gets a moving-average observer
    of its own, whose range came out narrower than the rows written into it (the reference model:
    ±3.3 against ±5.5 in layer 0, cached keys clipped, 16a8w top-1 agreement 91.8 %)."""
    import torch
    from torchao.quantization.pt2e.quantizer import SharedQuantizationSpec

    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target != torch.ops.aten.cat.default or len(node.args[0]) != 2:
            continue
        past, new = node.args[0]
        annotation = node.meta.get("quantization_annotation")
        if past.op == "placeholder" and past.name.startswith(("k_past", "v_past")) and annotation is not None:
            annotation.input_qspec_map[past] = SharedQuantizationSpec(new)


def _static_quantizer(options, graph_module):
    no_download()
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype

    quantizer = QnnQuantizer()
    quantizer.set_default_quant_config(getattr(QuantDtype, QUANT_DTYPES[options.recipe]), is_linear_per_channel=True)
    quantizer.add_custom_quant_annotations((share_cache_encodings,))
    if options.recipe == "16a4w_block":
        linears = [n.name for n in graph_module.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
        quantizer.set_block_size_map({name: (1, options.block_size) for name in linears})
    return quantizer


def _qnn_partitioner(specs: list):
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner

    return QnnPartitioner(specs)


def _qnn_context(specs: dict):
    from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import QnnManagerContext

    return QnnManagerContext(specs)


def _export_transform(program):  # QNN's passes on the exported graph, as to_edge_transform_and_lower_to_qnn runs them
    return qnn_pass_manager().transform_for_export_pipeline(program)


def _edge_passes(program, specs):
    return qnn_pass_manager().get_to_edge_transform_passes(program, compiler_specs=specs)


def _grouped(p: QnnPlan) -> GroupedLowering:
    return GroupedLowering(
        groups=p.groups,
        compile_specs=compile_specs(p),
        partitioner=_qnn_partitioner,
        context=_qnn_context,
        export_transform=_export_transform,
        edge_passes=_edge_passes,
        check=lambda edge, specs: check_lowered(edge, p),
    )


def configure(options: QnnOptions, methods=None) -> Target:
    """The QNN target with these options; given the program's methods, its plan is checked now,
    before any work (the same checks run again when lowering)."""
    if methods is not None:
        plan(options, methods)
    return dataclasses.replace(
        TARGET, grouped=lambda ms: _grouped(plan(options, ms)), compile_spec=lambda ms: summary(plan(options, ms))
    )


TARGET = Target(
    name="qnn",
    description="Qualcomm HTP (quantize and evaluate anywhere; lowering needs the QNN SDK)",
    recipes=tuple(QUANT_DTYPES),
    partitioners=list,
    static_quantizer=_static_quantizer,
    lowering_blocked=_lowering_blocked,
    grouped=lambda methods: _grouped(plan(QnnOptions(), methods)),
    compile_spec=lambda methods: summary(plan(QnnOptions(), methods)),
    cache_io=True,
)
