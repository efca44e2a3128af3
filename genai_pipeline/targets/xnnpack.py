"""XNNPACK: ExecuTorch's CPU delegate (x86 and Arm). Delegated weights are stored as named data
keyed by content, so the methods of one program share a single copy."""

import copy
import ctypes
import functools
import mmap
import sys

import torch
from torch import nn

from genai_pipeline.targets import Target
from genai_pipeline.upstream.xnnpack_dynamic_slice import delegate_dynamic_slices

_madvise = ctypes.CDLL(None, use_errno=True).madvise if sys.platform == "linux" else None


def _copy_sharing_weights(cls, program, compile_specs):
    """The hook ExecuTorch calls to isolate each partition before `preprocess`, minus the weights.
    Its default deep-copies the partition's weights too, and holds the copies of every partition
    of every method at once: two extra copies of a hybrid program's weights. XNNPACK's preprocess
    replaces constants, never writes into them, so sharing them is safe."""
    weights = (*program.state_dict.values(), *program.constants.values())
    return copy.deepcopy(program, memo={id(w): w for w in weights})


def _page_out(tensors) -> None:
    """Hint the kernel to reclaim the pages behind `tensors` that are memory-mapped files (Linux
    MADV_PAGEOUT). Checkpoint weights are read from mapped safetensors files: once a partition's
    weights are serialized, their pages are clean copies of the file and can go, to be read again
    only if something reads them again. Anonymous memory (e.g. quantized weights) is left alone."""
    if _madvise is None:
        return
    with open("/proc/self/maps") as maps:  # [start, end) of every file mapping: lines with an inode
        files = [tuple(int(a, 16) for a in f[0].split("-")) for f in map(str.split, maps) if len(f) >= 6 and f[4] != "0"]
    page = mmap.PAGESIZE
    for t in tensors:
        start, end = t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()
        first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor
        if last > first and any(lo <= first and last <= hi for lo, hi in files):
            _madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 21)  # 21: MADV_PAGEOUT


def _forget_refused_nodes() -> None:
    """XNNPACK's partitioner configs keep the last node they refused (for a debug message), and
    with it that node's graph and the weights its metadata holds, for the life of the process.
    Partitioning is over when preprocess starts."""
    from executorch.backends.xnnpack.partition.config import gemm_configs, generic_node_configs, node_configs, xnnpack_config

    for config in (gemm_configs, generic_node_configs, node_configs, xnnpack_config):
        config.why.node = None


def _preprocess_sharing_data(cls, programs, compile_specs):
    """ExecuTorch's default `preprocess_multimethod`, holding one bytes object per named weight:
    each method serializes its partitions on its own, so every weight the methods share would
    otherwise sit in memory once per method until the program is written. XNNPACK names weights
    by the SHA-256 of their bytes, so one name is one content."""
    _forget_refused_nodes()
    results, by_name = {}, {}
    for method, partitions in programs.items():
        results[method] = []
        for partition, specs in zip(partitions, compile_specs[method]):
            result = cls.preprocess(partition, specs)
            _page_out(partition.state_dict.values())
            store = result.data_store_output  # deduplicated now, before the next partition adds its own
            for name, entry in (store.pte_data if store is not None else {}).items():
                store.buffers[entry.buffer_index] = by_name.setdefault(name, store.buffers[entry.buffer_index])
            results[method].append(result)
    return results


def _op_name(target) -> str:
    return getattr(target, "__name__", str(target))  # "aten.cat.default" for an edge op


def _ops_rewritten_by() -> dict[str, list[set[str]]]:
    """{pass class name: op sets}, for the passes of XNNPACK's preprocess that rewrite only certain
    ops (a single op, or one of the patterns they match): such a pass can change a partition only
    if the partition holds every op of one of its sets."""
    from executorch.backends.xnnpack._passes import DecomposeBatchNorm, FuseActivationPass
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa
    from executorch.exir.passes.dim_order_ops_registry import MemoryFormatOpsMap

    def patterns(graphs) -> list[set[str]]:
        return [{_op_name(n.target) for n in g.graph.nodes if n.op == "call_function"} for g in graphs]

    def each(*ops) -> list[set[str]]:
        return [{_op_name(op)} for op in ops]

    return {
        "ConvertToUpsampleBilinear2d": patterns(bilinear_2d.get_graphs()),
        "ConvertToSDPAPass": patterns(sdpa.get_graphs()),
        "ConvertToLinearPass": each("aten.mm.default", "aten.addmm.default", "aten.bmm.default"),
        "FuseBatchNormPass": each(*DecomposeBatchNorm.BATCH_NORM_OPS),
        "DecomposeBatchNorm": each(*DecomposeBatchNorm.BATCH_NORM_OPS),
        "FuseActivationPass": each(*FuseActivationPass.FUSEABLE_ACTIVATIONS),
        "DecomposeConcatenate": each("aten.cat.default"),
        "RemoveGetItemPass": each("aten.max_pool2d_with_indices.default", "aten.max.dim"),
        "Conv1dUnsqueezePass": each("aten.convolution.default"),
        "PReLUReshapePass": each("aten._prelu_kernel.default"),
        "RemoveRedundantCopyPass": each("aten._to_copy.default"),
        "DimOrderOpsRevertPass": each(*map(_op_name, MemoryFormatOpsMap)),
    }


def _may_change(pass_, graph, rewrites: dict[str, list[set[str]]]) -> bool:
    """False for a pass that has nothing to rewrite in `graph`."""
    if pass_.__name__ == "PropagateCustomMetaPass":  # copies node.meta["custom"] to q/dq nodes
        return any("custom" in n.meta for n in graph.nodes)
    if pass_.__name__ not in rewrites:
        return True
    present = {_op_name(n.target) for n in graph.nodes if n.op == "call_function"}
    return any(ops <= present for ops in rewrites[pass_.__name__])


@functools.cache
def _pass_manager_skipping_idle_passes():
    """XNNPACK's preprocess pass manager, minus the passes with nothing to rewrite in a partition.
    Each pass re-traces the whole partition with fake tensors even when it changes nothing; with a
    symbolic sequence length the passes are ~45 % of lowering a decoder, and 11 of the 17 never
    apply to one (batch norm, convolutions, upsampling, ...). Whether a pass applies is decided on
    the graph as the passes before it left it: they add ops (e.g. `_to_copy`) later ones rewrite."""
    from executorch.backends.xnnpack._passes import XNNPACKPass, XNNPACKPassManager
    from executorch.exir.pass_base import ExportPass
    from executorch.exir.program._program import _transform

    rewrites = _ops_rewritten_by()

    class PassManager(XNNPACKPassManager):
        def transform(self):
            program = self.exported_program
            for pass_ in self.passes:
                if not _may_change(pass_, program.graph, rewrites):
                    continue
                assert issubclass(pass_, ExportPass), pass_  # what XNNPACKPassManager accepts
                program = _transform(program, pass_(program) if issubclass(pass_, XNNPACKPass) else pass_())
            return program

    return PassManager


def _partitioners() -> list:
    from executorch.backends.xnnpack import xnnpack_preprocess
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    # Both are hooks ExecuTorch gives backends to override; these keep lowering within ~2x the weights.
    XnnpackBackend.copy_exported_program_for_preprocess = classmethod(_copy_sharing_weights)
    XnnpackBackend.preprocess_multimethod = classmethod(_preprocess_sharing_data)
    # Not a hook: the name `preprocess` looks up when it runs its passes (output byte-identical).
    xnnpack_preprocess.XNNPACKPassManager = _pass_manager_skipping_idle_passes()
    delegate_dynamic_slices()  # patches XNNPACK's slice config and serializer (see there)
    return [XnnpackPartitioner()]


def _static_quantizer(options, graph_module):
    """8a8w: static per-tensor int8 activations, per-channel int8 weights (symmetric)."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    # The LM head sees the widest activation range of the model: one static scale for it costs
    # the most perplexity, so it quantizes its input per token at run time instead.
    dynamic = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True)
    return quantizer.set_module_name("decoder.output", dynamic)


class _PairSwappedEmbedding(nn.Module):
    """A lookup in the table with each pair of columns (2k, 2k+1) swapped, swapped back.

    A tied int4 table is packed two values a byte by both of its users, in opposite orders:
    ExecuTorch's `embedding_4bit` puts column 2k in the high nibble, XNNPACK's LM head in the low
    one. Swapping the lookup's columns makes its packed bytes those of the head, so the program
    stores them once (genai_pipeline/upstream/executorch_program_manager.py); swapping back costs a
    permutation of `dim` values a token. The pairs stay inside their quantization groups, so the
    scales are unchanged."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        w = embedding.weight
        swapped = torch.arange(w.shape[1]).view(-1, 2).flip(-1).flatten()
        table = type(w)(w.qdata[:, swapped].contiguous(), w.scale, w.zero_point, w.target_dtype, w.block_size, w.dtype, w.activation_quantization)
        self.embedding = nn.Embedding(*w.shape, _weight=table, _freeze=True)
        # One gather outside the delegates (a view + flip would add a delegate call for the view).
        self.register_buffer("swapped", swapped, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens).index_select(-1, self.swapped)


def _int4_table_of(weight):
    """(qdata, scale, zero_point, block_size) of a torchao int4 tensor, else None."""
    if type(weight).__name__ != "IntxUnpackedToInt8Tensor" or weight.target_dtype != torch.int4:
        return None
    return weight.qdata, weight.scale, weight.zero_point, tuple(weight.block_size)


def _swap_tied_int4_lookup(decoder) -> None:
    """When the lookup and the LM head hold the same int4 values, scales and groups (a tied
    embedding, `8da4w` with `--embedding 4w`), the lookup reads the table with its column pairs
    swapped: see _PairSwappedEmbedding."""
    lookup, head = decoder.tok_embeddings, decoder.output
    if not decoder.config.tie_embeddings or not isinstance(lookup, nn.Embedding):
        return  # untied, or swapped already (prefill and decode share one decoder)
    a, b = _int4_table_of(lookup.weight), _int4_table_of(head.weight)
    if a is None or b is None or a[3] != b[3] or a[3][1] % 2 or not all(torch.equal(x, y) for x, y in zip(a[:3], b[:3])):
        return
    decoder.tok_embeddings = _PairSwappedEmbedding(lookup)


def _adapt_for_lowering(module, static_shapes: bool) -> None:
    from genai_pipeline.models.decoder import Decoder, RMSNorm
    from genai_pipeline.quantize import concat_rows

    for norm in module.modules():
        if isinstance(norm, RMSNorm):
            norm.mean_by_matmul()
    for decoder in [m for m in module.modules() if isinstance(m, Decoder)]:
        _swap_tied_int4_lookup(decoder)
        # slices (fused outputs', RoPE's) of a dynamic-length tensor stay inside XNNPACK's delegates
        # only with delegate_dynamic_slices (outside, they would split every layer's delegate)
        dynamic_slices = delegate_dynamic_slices()
        if not dynamic_slices:
            decoder.swap_rope_halves_by_matmul()
        if static_shapes or dynamic_slices:
            decoder.fuse_projections(concat_rows)


TARGET = Target(
    name="xnnpack",
    description="CPU via the XNNPACK delegate",
    recipes=("fp32", "8da4w", "8da8w", "8a8w"),
    partitioners=_partitioners,
    embedding_recipes=("8w", "4w"),
    static_quantizer=_static_quantizer,
    adapt_for_lowering=_adapt_for_lowering,
)
