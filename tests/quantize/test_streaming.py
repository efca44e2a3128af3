"""quantize/streaming.py: the decoder quantized block by block, its weights read from the checkpoint
a block at a time, equals the whole-model pipeline (rotation, one calibration pass of the whole
rotated model, smoothing, GPTQ, the recipes) bit for bit, on the reference model's real weights."""

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import REFERENCE
from torch import nn

from genai_pipeline.checkpoints.block_loader import offload
from genai_pipeline.checkpoints.hf import load_decoder, open_decoder
from genai_pipeline.options import QuantOptions
from genai_pipeline.quantize.calibration import input_statistics
from genai_pipeline.quantize.gptq import gptq_names, gptq_weights
from genai_pipeline.quantize.recipes import quantize_module
from genai_pipeline.quantize.rotation import rotate
from genai_pipeline.quantize.smoothing import smooth, smoothed_hessians, smoothed_inputs, smoothing_scales
from genai_pipeline.quantize.streaming import Calibration, quantize_blocks
from genai_pipeline.registry import get_spec
from genai_pipeline.tokenizer import Tokenizer

SPEC = get_spec("reference")
WINDOW = 64
OPTIONS = QuantOptions(recipe="8da4w")  # the default: rotation, smoothing, GPTQ, the 8-bit rules


@pytest.fixture(scope="module")
def samples():
    tokens = Tokenizer.from_folder(REFERENCE).encode((REFERENCE / "sample.txt").read_text()[:6000])
    return [tokens[:300], tokens[300:520]]  # two samples, windows of 64 with a short last one


def whole_model(samples, options=OPTIONS):
    """The pipeline as it ran before streaming: every stage over the whole float model."""
    model = load_decoder(SPEC, REFERENCE, WINDOW)
    rotate(model)
    names = gptq_names(model, options)
    absmax, hessians = input_statistics(model, samples, WINDOW, names)
    scales = smoothing_scales(model, absmax, options.smooth)
    smooth(model, scales)
    hessians = smoothed_hessians(hessians, smoothed_inputs(model, scales))
    int4 = gptq_weights(model, names, samples, WINDOW, options.group_size, hessians)
    quantize_module(model, options, int4)
    return model, int4, scales


def weights(model: nn.Module) -> dict[str, tuple[torch.Tensor, ...]]:
    out = {}
    for name, p in model.named_parameters():
        parts = ("qdata", "scale", "zero_point") if hasattr(p, "qdata") else None
        out[name] = tuple(getattr(p, f) for f in parts) if parts else (p.detach(),)
    return out


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        for x, y in zip(wa[name], wb[name]):
            assert x.dtype == y.dtype and torch.equal(x, y), name


def test_streamed_from_the_checkpoint_equals_the_whole_model_pipeline(samples, capfd, tmp_path):
    """As `genai export` streams: each block's quantized weights moved to a file once made."""
    want, want_int4, want_scales = whole_model(samples)
    decoder, loader = open_decoder(SPEC, REFERENCE, WINDOW)
    assert decoder.layers[0].attention.wq.weight.is_meta  # nothing read yet
    capfd.readouterr()
    streamed = quantize_blocks(decoder, loader, OPTIONS, Calibration(samples, WINDOW), weights_folder=tmp_path)
    assert "kernel_runtime_context" not in capfd.readouterr().err  # ExecuTorch's C++ logs kept off the terminal
    mapped = [line for line in open("/proc/self/maps") if str(tmp_path) in line]
    assert {f".layers.{i}.weights" for i in range(len(decoder.layers))} | {".outer.weights"} == {
        Path(line.split()[5]).name for line in mapped
    }
    assert not any(tmp_path.iterdir())  # unlinked once mapped
    assert_same_weights(decoder, want)
    assert streamed.int4.keys() == want_int4.keys() and streamed.scales.keys() == want_scales.keys()
    assert all(torch.equal(streamed.int4[k][0], want_int4[k][0]) for k in want_int4)
    assert all(torch.equal(streamed.scales[k], want_scales[k]) for k in want_scales)
    assert streamed.plan["output"] == "8da4w" and streamed.plan["layers.0.attention.wv"] == "8da8w"
    # the KV cache is left empty, as the whole-model pipeline leaves it
    assert all(not b.abs().sum() for n, b in decoder.named_buffers() if "cache" in n)


def test_replayed_from_the_chosen_weights_equals_the_export(samples):
    """`genai eval`'s rebuild: the same blocks, GPTQ's values and the scales given, nothing measured;
    here with the tied table's first rows at 8 bits (models/table_parts.py), which the rebuild splits
    off again from the whole head's chosen values."""
    options = dataclasses.replace(OPTIONS, table_8bit_rows=1000)
    decoder, loader = open_decoder(SPEC, REFERENCE, WINDOW)
    streamed = quantize_blocks(decoder, loader, options, Calibration(samples, WINDOW))
    replay, loader = open_decoder(SPEC, REFERENCE, WINDOW)
    quantize_blocks(replay, loader, options, given=copy.copy(streamed.int4), scales=streamed.scales)
    assert_same_weights(replay, decoder)

    plan = {k: v for k, v in streamed.plan.items() if not k.startswith("layers.")}
    assert plan == {
        "tok_embeddings.first": "emb8w",
        "tok_embeddings.rest": "emb4w",
        "output.first": "8da8w",
        "output.rest": "8da4w",
        "head_rotation": "fp32",
    }
    lookup, head = decoder.tok_embeddings, decoder.output
    gptq_values, _ = streamed.int4["output.weight"]  # GPTQ's whole head, as eval is given it again
    assert gptq_values.shape[0] == SPEC.config.vocab_size
    assert torch.equal(head.rest.weight.qdata, gptq_values[1000:])  # the rest: GPTQ's rows as chosen
    assert torch.equal(lookup.rest.weight.qdata, head.rest.weight.qdata)  # tied: one set of values per part
    assert torch.equal(lookup.first.weight.qdata, head.first.weight.qdata)
    assert head.first.weight.qdata.shape == (1000, SPEC.config.dim) and head.first.weight.target_dtype == torch.int8


def test_a_cache_io_decoder_is_calibrated_as_the_kv_cache_one(samples):
    """The cache-I/O form has no KV-cache buffers: each block borrows one while it is measured."""
    kv, loader = open_decoder(SPEC, REFERENCE, WINDOW)
    quantize_blocks(kv, loader, OPTIONS, Calibration(samples, WINDOW))
    cache_io, loader = open_decoder(SPEC, REFERENCE, WINDOW)
    cache_io.use_cache_io()
    quantize_blocks(cache_io, loader, OPTIONS, Calibration(samples, WINDOW))
    assert_same_weights(cache_io, kv)
    assert all(layer.attention.kv_cache is None for layer in cache_io.layers)


def test_an_offloaded_decoder_computes_the_loaded_ones_logits_holding_one_block():
    loaded = load_decoder(SPEC, REFERENCE, WINDOW)
    decoder, loader = open_decoder(SPEC, REFERENCE, WINDOW)
    offloaded = offload(decoder, loader)
    tokens = torch.tensor([list(range(1, 40))])
    seen = []
    offloaded.layers[1].register_forward_pre_hook(
        lambda *_: seen.append([not layer.attention.wq.weight.is_meta for layer in offloaded.layers])
    )
    assert torch.equal(offloaded(tokens, torch.tensor([0])), loaded(tokens, torch.tensor([0])))
    assert seen == [[i == 1 for i in range(len(offloaded.layers))]]  # block 1 alone (hooks run in order)
    assert all(layer.attention.wq.weight.is_meta for layer in offloaded.layers)  # all let go after
