"""A tied embedding (token embedding = LM head weight) is stored once in a program, and the program
still gives the eager model's logits: a Gemma 3 shape with its 262144-row table (1 layer, width 64,
random weights), the shipped reference model in fp32, and its shape with one block of random
weights: 8da8w with an 8w embedding, 8da4w with a 4w one, and 8da4w's table in parts (its first
rows at 8 bits, the rest at 4)."""

import dataclasses

import pytest
import torch
from test_weight_sharing import inspect_json

from genai_pipeline.compile import compile_artifacts
from genai_pipeline.options import PrepareOptions, QuantOptions
from genai_pipeline.prepare import prepare
from genai_pipeline.quantize import quantize
from genai_pipeline.registry import get_spec
from genai_pipeline.targets import get_target

# 8da4w with its 4-bit head and 4w lookup, without calibration (what is stored does not depend on it)
UNCALIBRATED_8DA4W = QuantOptions(recipe="8da4w", embedding="4w", head="8da4w", weight_rule="mse", smooth=None)


def gemma3_shape():
    spec = get_spec("gemma3-1b")
    config = dataclasses.replace(
        spec.config,
        dim=64,
        n_layers=1,
        hidden_dim=128,
        n_heads=2,
        n_kv_heads=1,
        head_dim=32,
        rope_dim=32,
        sliding_window=32,
        sliding_window_layers=(0,),
    )
    return dataclasses.replace(spec, config=config)


def reference_shape():
    # What is stored depends on the table, not on the blocks: one block of random weights lowers in
    # a fraction of the shipped model's time.
    spec = get_spec("reference")
    return dataclasses.replace(spec, checkpoint=None, config=dataclasses.replace(spec.config, n_layers=1))


def export(spec, quant: QuantOptions, out):
    prepared = quantize(
        prepare(spec, PrepareOptions(max_seq_len=64, prefill_len=8, long_prefill_len=0)), quant, get_target("xnnpack")
    )
    compile_artifacts(prepared, get_target("xnnpack"), out)
    return prepared, out / "text_decoder.pte"


def prefill_logits_match_eager(prepared, pte, rtol):
    """The program's prefill logits against the (quantized) eager graph it was lowered from."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  kernels the program calls
    import executorch.kernels.quantized  # noqa: F401
    from executorch.runtime import Runtime

    (artifact,) = prepared.artifacts.values()
    graph = next(g for name, g in artifact.graphs.items() if name.value == "prefill_chunk")
    tokens = torch.randint(
        0, prepared.config.vocab_size, graph.example_inputs[0].shape, generator=torch.Generator().manual_seed(0)
    )
    inputs = (tokens, *graph.example_inputs[1:])
    got = Runtime.get().load_program(pte).load_method("prefill_chunk").execute(list(inputs))[0]
    want = graph.module(*inputs)
    assert torch.linalg.norm(got - want) <= rtol * torch.linalg.norm(want)


def test_gemma3_table_of_262144_rows_is_stored_once(tmp_path):
    spec = gemma3_shape()
    prepared, pte = export(spec, QuantOptions(), tmp_path)
    report = inspect_json(pte)
    weights = spec.config.num_params * 4  # the tied table once
    assert report["file_bytes"] <= 1.02 * weights, report["file_bytes"] / weights
    table = spec.config.vocab_size * spec.config.dim * 4
    assert report["weights"]["named_data_in_constant_segment_bytes"] == table  # the LM head reads the lookup's table
    assert report["weights"]["stored_twice_bytes"] == 0
    prefill_logits_match_eager(prepared, pte, rtol=1e-5)


def test_reference_program_stores_its_tied_table_once(export_reference):
    config = get_spec("reference").config
    report = inspect_json(export_reference("hybrid") / "text_decoder.pte")
    assert report["file_bytes"] <= 1.02 * config.num_params * 4, report["file_bytes"] / (config.num_params * 4)
    assert report["weights"]["named_data_in_constant_segment_bytes"] == config.vocab_size * config.dim * 4
    assert report["weights"]["stored_twice_bytes"] == 0


@pytest.mark.parametrize("embedding", ["8w"])
def test_8da8w_head_reads_the_int8_table_and_scales_of_the_lookup(tmp_path, embedding):
    # Both are int8 per row, symmetric: the same values and scales, stored once.
    spec = reference_shape()
    prepared, pte = export(
        spec, QuantOptions(recipe="8da8w", embedding=embedding, weight_rule="mse", smooth=None), tmp_path
    )
    report = inspect_json(pte)
    table = spec.config.vocab_size * (spec.config.dim + 4)  # int8 values, an fp32 scale per row
    assert report["weights"]["named_data_in_constant_segment_bytes"] == table
    assert report["weights"]["stored_twice_bytes"] == 0
    prefill_logits_match_eager(prepared, pte, rtol=2e-2)


def test_8da4w_head_reads_the_int4_values_of_the_lookup(tmp_path):
    # The same int4 values and groups, packed in opposite nibble orders: the lookup's table has its
    # column pairs swapped so that its bytes are the head's. The scales stay twice (fp32 for the
    # lookup, bf16 for XNNPACK).
    spec = reference_shape()
    prepared, pte = export(spec, UNCALIBRATED_8DA4W, tmp_path)
    report = inspect_json(pte)
    assert report["weights"]["named_data_in_constant_segment_bytes"] == spec.config.vocab_size * spec.config.dim // 2
    assert report["weights"]["stored_twice_bytes"] == 0
    prefill_logits_match_eager(prepared, pte, rtol=5e-2)


def test_a_table_in_parts_stores_each_part_once(tmp_path):
    # The first 1000 rows at 8 bits (8w lookup, 8da8w head: int8 values and per-row fp32 scales once),
    # the rest at 4 bits (pair-swapped int4 values once), and the program computes its QDQ model.
    spec = reference_shape()
    prepared, pte = export(spec, dataclasses.replace(UNCALIBRATED_8DA4W, table_8bit_rows=1000), tmp_path)
    assert "table1000rows=8w" in prepared.recipe
    report = inspect_json(pte)
    first, rest = 1000 * (spec.config.dim + 4), (spec.config.vocab_size - 1000) * spec.config.dim // 2
    assert report["weights"]["named_data_in_constant_segment_bytes"] == first + rest
    assert report["weights"]["stored_twice_bytes"] == 0
    prefill_logits_match_eager(prepared, pte, rtol=5e-2)


def test_an_untied_int4_lookup_is_left_alone(tiny_checkpoint):
    from genai_pipeline.checkpoints.hf import load_decoder
    from genai_pipeline.quantize.recipes import quantize_module
    from genai_pipeline.targets.xnnpack import adapt_for_lowering

    decoder = load_decoder(get_spec("smollm2-135m"), tiny_checkpoint, 32)
    quantize_module(decoder, QuantOptions(recipe="8da4w", embedding="4w"))
    adapt_for_lowering(decoder, True)
    assert isinstance(decoder.tok_embeddings, torch.nn.Embedding)
