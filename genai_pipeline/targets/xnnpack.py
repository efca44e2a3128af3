"""XNNPACK: ExecuTorch's CPU delegate (x86 and Arm). Delegated weights are stored as named data
keyed by content, so the methods of one program share a single copy. (What lowering to it changes in
ExecuTorch's XNNPACK backend is in upstream/xnnpack_preprocess.py and upstream/xnnpack_dynamic_slice.py.)"""

import torch
from torch import nn

from genai_pipeline.models.table_parts import TableLookup
from genai_pipeline.targets.target import Target
from genai_pipeline.upstream import xnnpack_preprocess
from genai_pipeline.upstream.xnnpack_dynamic_slice import delegate_dynamic_slices


def _partitioners() -> list:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    xnnpack_preprocess.install()  # once per process: XNNPACK's preprocess holding less, re-tracing less (see there)
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
        table = type(w)(
            w.qdata[:, swapped].contiguous(),
            w.scale,
            w.zero_point,
            w.target_dtype,
            w.block_size,
            w.dtype,
            w.activation_quantization,
        )
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
    embedding, `8da4w` with `--embedding 4w`; of a table in parts, the rest's), the lookup reads the
    table with its column pairs swapped: see _PairSwappedEmbedding."""
    owner, name, head = decoder, "tok_embeddings", decoder.output
    if isinstance(decoder.tok_embeddings, TableLookup):  # models/table_parts.py
        owner, name, head = decoder.tok_embeddings, "rest", decoder.output.rest
    lookup = getattr(owner, name)
    if not decoder.config.tie_embeddings or not isinstance(lookup, nn.Embedding):
        return  # untied, or swapped already (prefill and decode share one decoder)
    a, b = _int4_table_of(lookup.weight), _int4_table_of(head.weight)
    if (
        a is None
        or b is None
        or a[3] != b[3]
        or a[3][1] % 2
        or not all(torch.equal(x, y) for x, y in zip(a[:3], b[:3]))
    ):
        return
    setattr(owner, name, _PairSwappedEmbedding(lookup))


def adapt_for_lowering(module, static_shapes: bool) -> None:
    from genai_pipeline.models.decoder import Decoder, RMSNorm
    from genai_pipeline.quantize.weights import concat_rows

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
    adapt_for_lowering=adapt_for_lowering,
)
