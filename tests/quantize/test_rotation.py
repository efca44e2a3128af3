"""rotation.py: the rotated decoder computes what the float one does, in every family the decoder
serves (the residual stream rotated, or with sandwich norms the linears' inputs at run time);
per-token int8 activations lose less after it; what `genai eval` and the quant report read of a
rotated model is in the float model's basis; the run-time rotations lower inside XNNPACK's delegates."""

from __future__ import annotations

import copy

import pytest
import torch

from genai_pipeline.errors import InputError
from genai_pipeline.evaluate.text import block_outputs
from genai_pipeline.models.decoder import Decoder, DecoderConfig
from genai_pipeline.options import QuantOptions
from genai_pipeline.quantize.recipes import describe, quantize_module
from genai_pipeline.quantize.rotation import (
    SEED,
    can_rotate,
    hadamard,
    random_hadamard,
    rotate,
    rotate_inputs,
    rotates_inputs,
)
from genai_pipeline.quantize.weights import concat_rows


def _decoder(seed: int = 0, **config) -> Decoder:
    torch.manual_seed(seed)
    c = DecoderConfig(
        **{"vocab_size": 97, "dim": 96, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "hidden_dim": 192, **config}
    )
    model = Decoder(c, 32).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms away from 1, so folding them is tested
            p.add_(torch.randn_like(p) * 0.2)
    model.tie_weights()
    return model


def _logits(model, tokens):
    return model(torch.tensor([tokens]), torch.tensor([0]))


@pytest.mark.parametrize("dim", [64, 96, 576])
def test_random_hadamard_is_orthogonal_and_spreads_every_coordinate(dim):
    q = random_hadamard(dim)
    assert torch.allclose(q @ q.T, torch.eye(dim, dtype=torch.float64), atol=1e-12)
    # a one-hot (an outlier channel) comes out spread: no coordinate keeps much of it
    assert q.abs().max() < 4 / dim**0.5
    assert torch.equal(q, random_hadamard(dim))  # seeded: genai eval rebuilds the export's


def _dense_hadamard(dim: int) -> torch.Tensor:
    """Q written out as one matrix, as rotation.py built it before it was factored: the seeded signs
    times H_power (x) the odd part's random orthogonal matrix (the same draws of the same generator)."""
    g = torch.Generator().manual_seed(SEED)
    power = dim & -dim
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < power:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    odd, r = torch.linalg.qr(torch.randn(dim // power, dim // power, generator=g, dtype=torch.float64))
    odd = (odd * torch.sign(torch.diagonal(r))).contiguous()  # kron needs it
    signs = torch.randint(0, 2, (dim,), generator=g).double() * 2 - 1
    return signs[:, None] * torch.kron(h / power**0.5, odd)


@pytest.mark.parametrize("dim", [1, 64, 96, 576, 640, 3 * 1024, 4096])
def test_the_factored_rotation_is_the_dense_product(dim):
    """Q applied factor by factor (Sylvester blocks of at most 64, the odd part in the last) gives the
    product with the whole matrix, on both sides, and the rotation reads what it did dense."""
    q, dense = hadamard(dim), _dense_hadamard(dim)
    assert len(q.factors) == (1 if dim <= 1024 else 2)  # [64, 48] for 3072: the odd part joins the last
    x = torch.randn(5, 3, dim, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(q.right(x), x.double() @ dense, rtol=0, atol=1e-12)
    w = torch.randn(dim, 7, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(q.left_transposed(w), dense.T @ w.double(), rtol=0, atol=1e-12)
    assert torch.allclose(random_hadamard(dim), dense, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "config",
    [
        dict(tie_embeddings=True),  # SmolLM2 / Llama 3.2: the head reads the rotated table through head_rotation
        dict(qkv_bias=True),  # Qwen 2: biases of the linears that read the residual stream
        dict(
            tie_embeddings=True,
            norm_unit_offset=True,
            scale_embeddings=True,
            activation="gelu_tanh",
            qk_norm=True,
            final_logit_softcap=30.0,
        ),  # Gemma-like: x * (1 + w) norms
        dict(embedding_multiplier=3.0, residual_multiplier=0.5, logit_divisor=2.5),  # Granite
        dict(tie_embeddings=True, qk_norm=True, conv_layers=(0,)),  # LFM2: a short-convolution block
    ],
)
def test_rotated_decoder_computes_the_same_logits(config):
    model = _decoder(**config)
    rotated = copy.deepcopy(model)
    rotate(rotated)
    tokens = list(range(3, 40, 3))
    want, got = _logits(model, tokens), _logits(rotated, tokens)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    tied = config.get("tie_embeddings", False)
    assert (rotated.head_rotation is not None) == tied
    if tied:  # still one table for lookup and head
        assert rotated.output.weight.data_ptr() == rotated.tok_embeddings.weight.data_ptr()
    assert not torch.allclose(rotated.tok_embeddings.weight, model.tok_embeddings.weight)
    # the residual stream really is in another basis, and block_outputs reads it back in the float one
    inside = rotated.layers[0](
        rotated.embed(torch.tensor([tokens])), 0, rotated._rope_at(0, len(tokens)).get("global"), None
    )
    want_blocks, got_blocks = block_outputs(model, tokens), block_outputs(rotated, tokens)
    assert not torch.allclose(inside, want_blocks["layers.0"], atol=1e-3)
    for name, x in want_blocks.items():
        assert (got_blocks[name] - x).abs().max() < 1e-4 * x.abs().max(), name


def test_sandwich_norms_are_not_rotated():
    model = _decoder(sandwich_norms=True, norm_unit_offset=True)
    assert not can_rotate(model) and rotates_inputs(model)
    with pytest.raises(InputError, match="sandwich"):
        rotate(model)


SANDWICH = {
    # Gemma 2/3: pre- and post-norms scaled by (1 + w), q/k norms, a GQA wo
    "gemma": dict(
        sandwich_norms=True, norm_unit_offset=True, qk_norm=True, tie_embeddings=True, activation="gelu_tanh"
    ),
    # OLMo 2: post-norms only, q and k normed across heads; a bias on v
    "olmo2": dict(sandwich_norms=True, pre_norms=False, qk_norm=True, qk_norm_across_heads=True, qkv_bias=True),
}


@pytest.mark.parametrize("family", SANDWICH)
def test_rotated_inputs_compute_the_same_logits_and_leave_the_residual_stream(family):
    config = SANDWICH[family]
    model = _decoder(**config)
    rotated = copy.deepcopy(model)
    for block in rotated.layers:
        rotate_inputs(block)
    tokens = list(range(3, 40, 3))
    want = _logits(model, tokens)
    assert (_logits(rotated, tokens) - want).abs().max() < 1e-4 * want.abs().max()
    for block, before in zip(rotated.layers, model.layers):
        assert block.attention.wo_rotation is not None and block.feed_forward.w2_rotation is not None
        assert (getattr(block.attention_norm, "rotation", None) is not None) == config.get("pre_norms", True)
        assert not torch.allclose(block.feed_forward.w2.weight, before.feed_forward.w2.weight)
    # the residual stream is the float model's: no change of basis to read it back
    want_blocks, got_blocks = block_outputs(model, tokens), block_outputs(rotated, tokens)
    for name, x in want_blocks.items():
        assert (got_blocks[name] - x).abs().max() < 1e-4 * x.abs().max(), name
    rotated.fuse_projections(concat_rows)  # the lowered form: fused wq/wk/wv and w1/w3
    assert (_logits(rotated, tokens) - want).abs().max() < 1e-4 * want.abs().max()


def test_rotated_inputs_lower_the_loss_of_per_token_int8_activations():
    """Gemma's case: a pre-norm with a large scale on one channel (0037: up to 121), which neither
    folds nor smooths well; the block linears' per-token int8 inputs lose less once rotated (summed
    over four random models: a two-layer random model is chaotic, one seed alone can go either way)."""
    tokens = list(range(2, 62, 2))
    quant = QuantOptions(recipe="8da8w", embedding=None, smooth=None, overrides=(("^output$", "fp32"),))
    plain = rotated = 0.0
    for seed in range(1, 5):
        model = _decoder(seed=seed, **SANDWICH["gemma"])
        with torch.no_grad():
            for block in model.layers:
                block.attention_norm.weight[5] = 60.0
                block.ffn_norm.weight[5] = 60.0
        want = _logits(model, tokens)
        for rotate_them in (False, True):
            m = copy.deepcopy(model)
            for block in m.layers if rotate_them else ():
                rotate_inputs(block)
            quantize_module(m, quant)
            error = float((_logits(m, tokens) - want).pow(2).mean())
            plain, rotated = (plain + error, rotated) if not rotate_them else (plain, rotated + error)
    assert rotated < 0.5 * plain, (rotated, plain)


def test_rotation_lowers_the_loss_of_per_token_int8_activations():
    """A residual stream with an outlier channel (as real LLMs have): 8da8w's per-token int8
    activations spend their range on it; after rotation the error of the logits is smaller."""
    model = _decoder(seed=1, tie_embeddings=True)
    with torch.no_grad():
        model.tok_embeddings.weight[:, 5] += 25.0
        for block in model.layers:
            block.attention_norm.weight[5] = 30.0
            block.ffn_norm.weight[5] = 30.0
    tokens = list(range(2, 62, 2))
    want = _logits(model, tokens)

    def error(rotated: bool) -> float:
        m = copy.deepcopy(model)
        if rotated:
            rotate(m)
        quantize_module(m, QuantOptions(recipe="8da8w", embedding=None, smooth=None, rotate=rotated))
        return float((_logits(m, tokens) - want).pow(2).mean())

    plain, rotated = error(False), error(True)
    assert rotated < 0.5 * plain, (rotated, plain)


def test_rotation_is_recorded_and_off_where_it_does_not_apply():
    assert QuantOptions(recipe="8da4w").rotate and "-rot" in describe(QuantOptions(recipe="8da4w"))
    assert not QuantOptions(recipe="8a8w").rotate and not QuantOptions().rotate  # static and float: not rotated
    from genai_pipeline.options import quant_options_from

    assert quant_options_from({"recipe": "8da4w"}).rotate is False  # a manifest from before rotation
