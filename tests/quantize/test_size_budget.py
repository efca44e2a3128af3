"""size_budget: per-layer precision under a byte budget, chosen from measured gains."""

import dataclasses
import json
import re

import pytest
import torch
from conftest import Q4, REFERENCE

from genai_pipeline.cli import main
from genai_pipeline.errors import InputError
from genai_pipeline.evaluate.text import float_model, quantized_model
from genai_pipeline.manifest import Manifest
from genai_pipeline.options import CalibrationOptions, PrepareOptions, QuantOptions
from genai_pipeline.prepare import prepare
from genai_pipeline.quantize import quantize
from genai_pipeline.quantize.calibration import SENSITIVITY_TOKENS, gptq_samples, held_out_tokens
from genai_pipeline.quantize.multimodal import check_vision_language_quant
from genai_pipeline.quantize.recipes import linear_recipes
from genai_pipeline.quantize.rotation import rotate
from genai_pipeline.quantize.size_budget import (
    graph_bytes,
    layer_groups,
    linear_bytes,
    program_bytes,
    promote,
    promotion_gains,
    scored_positions,
    table_chunks,
    table_row_bytes,
)
from genai_pipeline.quantize.weights import q4_0_qparams, torchao_qparams
from genai_pipeline.registry import get_spec
from genai_pipeline.targets import get_target


def _reference_decoder(rotated: bool):
    decoder = next(
        iter(prepare(get_spec("reference"), PrepareOptions(max_seq_len=256, prefill_len=32)).artifacts.values())
    ).module
    if rotated:
        rotate(decoder)  # as quantize does first: the tied head gains a float linear
    return decoder


def _bytes(decoder, quant: QuantOptions) -> int:
    return program_bytes(decoder, linear_recipes(decoder, quant).get, quant.embedding, quant.group_size)


@pytest.mark.parametrize(
    "quant", [Q4, QuantOptions()], ids=["8da4w-emb8w", "fp32"]
)  # 8da4w + emb4w: the budget test below
def test_program_bytes_counts_what_the_program_stores_but_its_graphs(export_reference, quant):
    folder = export_reference("hybrid", quant)
    size = (folder / "text_decoder.pte").stat().st_size
    methods = Manifest.read(folder).artifacts["text_decoder"].methods
    estimate = _bytes(_reference_decoder(quant.rotate), quant)
    assert len(methods) == 3 and 0 <= size - estimate <= graph_bytes(4, len(methods)), (size, estimate)


def test_the_positions_scored_are_all_of_them_or_as_many_as_fit_evenly_spaced():
    assert torch.equal(scored_positions(512, 49_152), torch.arange(512))  # SmolLM2: every position
    gemma = scored_positions(512, 262_144)  # 1 << 25 logits: 128 positions
    assert len(gemma) == 128 and gemma[0] == 0 and gemma[-1] == 511 and set(torch.diff(gemma).tolist()) <= {4, 5}
    assert scored_positions(10, 1 << 26).tolist() == [9]  # at least one: the last


def test_layer_groups_are_one_kind_over_a_band_of_blocks():
    names = [f"layers.{i}.{kind}" for i in range(30) for kind in ("attention.wk", "feed_forward.w2")]
    groups = layer_groups(names, 30)
    assert len(groups) == 20 and groups["w2@27-29"] == tuple(f"layers.{i}.feed_forward.w2" for i in (27, 28, 29))
    kinds = (("attention", "wk"), ("feed_forward", "w2"))
    assert layer_groups(names[:8], 4) == {f"{k}@{i}-{i}": (f"layers.{i}.{p}.{k}",) for i in range(4) for p, k in kinds}


@torch.no_grad()
def test_the_measurement_finds_a_broken_layer_and_leaves_the_model_as_it_was():
    decoder = _reference_decoder(rotated=False)
    names = [n for n, m in decoder.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("layers.")]
    eight_bit = {}
    for n in names:
        weight = decoder.get_submodule(n).weight
        q, d = torchao_qparams(weight, weight.shape[1], bits=8, bf16=False)  # one scale per row: 8da8w's
        eight_bit[n] = q.float() * d
    four_bit = dict(eight_bit)  # as good as 8 bits: nothing to gain
    broken = "layers.2.feed_forward.w1"
    four_bit[broken] = four_bit[broken] + 0.05 * torch.randn_like(four_bit[broken])
    before = {k: v.clone() for k, v in decoder.state_dict().items()}
    tokens = [t % decoder.config.vocab_size for t in range(7, 7 + 2 * 96)]
    windows = [tokens[:96], tokens[96:]]
    gains = promotion_gains(decoder, four_bit, eight_bit, layer_groups(names, len(decoder.layers)), windows)
    assert max(gains, key=gains.get) == "w1@2-2" and gains["w1@2-2"] > 100 * max(
        abs(g) for k, g in gains.items() if k != "w1@2-2"
    )
    # a vocabulary too large for every position's logits: a quarter of them, evenly spaced, find it too
    sampled = promotion_gains(
        decoder, four_bit, eight_bit, layer_groups(names, len(decoder.layers)), windows, 24 * decoder.config.vocab_size
    )
    assert max(sampled, key=sampled.get) == "w1@2-2" and 0.8 < sampled["w1@2-2"] / gains["w1@2-2"] < 1.25
    after = decoder.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights and KV cache
    extra = linear_bytes(768, 256, "8da8w", 32) - linear_bytes(768, 256, "8da4w", 32)
    assert promote(decoder, four_bit, eight_bit, windows, extra, 32) == ((broken,), 0)  # no table given: no rows
    assert promote(decoder, four_bit, eight_bit, windows, extra - 1, 32) == ((), 0)  # it does not fit


def test_the_tables_candidates_are_its_first_rows_in_doubling_chunks():
    assert table_chunks(49152) == ((0, 1024), (1024, 2048), (2048, 4096), (4096, 8192), (8192, 16384))
    assert table_chunks(4096) == ((0, 1024), (1024, 2048)) and table_chunks(2047) == ()
    # Gemma 3's width: 644 bytes a row at 8 bits against 440 at 4 (docs/decisions/0038)
    assert table_row_bytes(640, 32) == 644 - 440


def test_the_measurement_finds_the_table_rows_that_matter_and_takes_them_in_order():
    """A tied table's chunks are candidates beside the block groups: a chunk the windows look up
    (the whole model runs) and one only the head reads; rows are promoted as a prefix only."""
    torch.manual_seed(0)  # the broken chunks' noise: not whatever the tests before left
    decoder = _reference_decoder(rotated=False)
    names = [n for n, m in decoder.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("layers.")]
    blocks = {n: decoder.get_submodule(n).weight.detach().clone() for n in names}  # nothing to gain there
    weights = decoder.output.weight.detach().clone()  # 8 bits are as good as float here
    tokens = [t % 1024 for t in range(7, 7 + 2 * 96)]  # ids in the first chunk only
    windows = [tokens[:96], tokens[96:]]
    groups = layer_groups(names, len(decoder.layers))
    before = {k: v.clone() for k, v in decoder.state_dict().items()}
    for broken, looked_up in (((0, 1024), True), ((1024, 2048), False)):
        four = weights.clone()
        four[slice(*broken)] += 0.05 * torch.randn_like(four[slice(*broken)])
        gains = promotion_gains(decoder, blocks, blocks, groups, windows, table=four)
        name = f"table@{broken[0]}-{broken[1] - 1}"
        assert max(gains, key=gains.get) == name and gains[name] > 100 * max(
            abs(g) for k, g in gains.items() if k != name
        ), looked_up
    assert all(torch.equal(before[k], v) for k, v in decoder.state_dict().items())
    assert decoder.output.weight.data_ptr() == decoder.tok_embeddings.weight.data_ptr()  # still one table
    row = table_row_bytes(decoder.config.dim, 32)
    # the second chunk gains, the first does not: nothing before it, so no rows
    assert promote(decoder, blocks, blocks, windows, 10 * 2048 * row, 32, four) == ((), 0)
    four[:1024] += 0.01 * torch.randn_like(four[:1024])  # the first gains a little: both fit, in order
    assert promote(decoder, blocks, blocks, windows, 2048 * row, 32, four) == ((), 2048)
    assert promote(decoder, blocks, blocks, windows, 2048 * row - 1, 32, four) == ((), 1024)


def test_an_export_under_a_budget_fits_it_and_eval_rebuilds_its_mix(tmp_path, capsys):
    decoder = _reference_decoder(rotated=True)
    smallest = _bytes(decoder, QuantOptions(recipe="8da4w", size_budget=1, promoted=()))
    largest = _bytes(decoder, QuantOptions(recipe="8da4w", overrides=((r"^layers\.", "8da8w"),)))
    budget = round((smallest + (largest - smallest) / 3 + graph_bytes(4, 1)) / 1e6, 3)
    out = tmp_path / "budget"
    argv = [
        "export",
        "reference",
        "--recipe",
        "8da4w",
        "--size-budget",
        str(budget),
        "--mode",
        "kv",
        "--max-seq-len",
        "256",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    assert "candidates at 8 bits" in capsys.readouterr().err
    manifest = Manifest.read(out)
    promoted, rows = manifest.quantization["promoted"], manifest.quantization["table_8bit_rows"]
    assert f"+emb4w+{f'table{rows}rows=8w+' if rows else ''}budget{budget:g}MB" in manifest.recipe
    assert 0 < len(promoted) < 4 * 7 and rows in (0, 1024, 2048)
    quant = QuantOptions(recipe="8da4w", size_budget=budget, promoted=promoted)
    size = (out / "text_decoder.pte").stat().st_size
    expected = _bytes(decoder, quant) + rows * table_row_bytes(decoder.config.dim, 32)
    assert 0 <= size - expected <= graph_bytes(4, 1) and size <= budget * 1e6  # a tied table: each part stored once
    rebuilt = quantized_model(out, manifest, float_model(manifest))
    eight = {
        n
        for n, m in rebuilt.named_modules()
        if n.startswith("layers.") and isinstance(m, torch.nn.Linear) and m.weight.target_dtype == torch.int8
    }
    assert eight == set(promoted)
    assert rebuilt.output.first.out_features == rows if rows else isinstance(rebuilt.output, torch.nn.Linear)
    assert main(["eval", str(out), "--text", str(REFERENCE / "heldout.txt"), "--max-tokens", "300", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["top1_agreement"] > 0.8


def test_a_budget_over_given_int4_weights_keeps_them_where_it_promotes_nothing():
    """A GGUF's Q4_0 tensors (here: llama.cpp's rule on the reference model's weights): the layers the
    budget promotes take 8 bits, the others the given integers as they are."""
    prepared = prepare(get_spec("reference"), PrepareOptions(mode="kv", max_seq_len=256))
    decoder = next(iter(prepared.artifacts.values())).module
    given = {
        f"{n}.weight": q4_0_qparams(m.weight, 32)
        for n, m in decoder.named_modules()
        if isinstance(m, torch.nn.Linear) and n.startswith("layers.")
    }
    smallest = _bytes(decoder, QuantOptions(recipe="8da4w", size_budget=1, promoted=(), rotate=False))
    budget = (smallest + 400_000 + graph_bytes(4, 1)) / 1e6
    quantized = quantize(
        prepared, QuantOptions(recipe="8da4w", size_budget=budget), get_target("xnnpack"), given=dict(given)
    )
    promoted, module = quantized.quantization["promoted"], next(iter(quantized.artifacts.values())).module
    assert 0 < len(promoted) < len(given)
    for name, (q, _) in given.items():
        weight = module.get_submodule(name.removesuffix(".weight")).weight
        if name.removesuffix(".weight") in promoted:
            assert weight.target_dtype == torch.int8
        else:
            assert weight.target_dtype == torch.int4 and torch.equal(weight.qdata, q)


def test_a_budget_measures_on_calibration_tokens_gptq_does_not_fit(tmp_path):
    prepared = prepare(get_spec("reference"), PrepareOptions(max_seq_len=256))
    default = QuantOptions(recipe="8da4w", size_budget=5)
    assert gptq_samples(prepared, default) == gptq_samples(
        prepared, QuantOptions(recipe="8da4w")
    )  # the first 4096 tokens
    fit, held = gptq_samples(prepared, default)[0], held_out_tokens(prepared, default)
    assert len(held) == SENSITIVITY_TOKENS and held[:8] != fit[:8]
    text = tmp_path / "calib.txt"
    text.write_text((REFERENCE / "sample.txt").read_text())
    quant = dataclasses.replace(default, calibration=CalibrationOptions(datasets=(f"text:{text}",)))
    everything = gptq_samples(prepared, dataclasses.replace(quant, size_budget=None))
    fit, held = gptq_samples(prepared, quant), held_out_tokens(prepared, quant)
    assert len(held) == SENSITIVITY_TOKENS and [t for s in fit for t in s] + held == [t for s in everything for t in s]
    text.write_text("a few words of calibration text\n" * 20)
    with pytest.raises(InputError, match=f"at least {2 * SENSITIVITY_TOKENS} tokens"):
        gptq_samples(prepared, quant)


def test_a_budget_below_the_all_4_bit_program_is_one_line_before_any_work(tmp_path, capsys):
    out = tmp_path / "small"
    assert (
        main(
            [
                "export",
                "reference",
                "--recipe",
                "8da4w",
                "--size-budget",
                "0.5",
                "--max-seq-len",
                "256",
                "--out",
                str(out),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "--size-budget 0.5 MB is too small: with every layer at 4 bits" in err
        and not re.search(r"(?<![\w/-])gptq(?![\w/-])", err)  # no GPTQ log line (a path may hold the word)
        and "Traceback" not in err
    )
    assert not out.exists()


@pytest.mark.parametrize("bad", [dict(recipe="8da8w", size_budget=100), dict(recipe="8da4w", size_budget=0)])
def test_a_budget_takes_the_4_bit_recipe_and_a_positive_size(bad):
    with pytest.raises(InputError, match="--size-budget"):
        QuantOptions(**bad)


def test_vision_language_models_refuse_a_budget():
    with pytest.raises(InputError, match="--size-budget"):
        check_vision_language_quant(QuantOptions(recipe="8da4w", size_budget=100))
