"""Our eager decoder against transformers' reference models, loaded through our HF loader."""

import dataclasses

import pytest
import torch
from conftest import TINY_MAX_SEQ, TINY_VOCAB, save_hf_checkpoint
from tiny_hf import max_diff_to_transformers

from genai_pipeline.models.decoder import DecoderConfig, LongRopeScaling


def test_llama_matches_transformers(tiny_checkpoint):
    """GQA, Llama-3 RoPE scaling, untied head: 16-token prefill then 8 decode steps."""
    assert max_diff_to_transformers(tiny_checkpoint, "smollm2-135m") <= 1e-4


def test_llama_tied_embeddings_match_transformers(tmp_path):
    save_hf_checkpoint(tmp_path, tie_word_embeddings=True, num_key_value_heads=4)
    assert max_diff_to_transformers(tmp_path, "smollm2-135m") <= 1e-4


def test_last_only_equals_last_row_of_all_positions(tiny_eager):
    model = tiny_eager()
    ids = torch.randint(0, TINY_VOCAB, (1, 11))
    with torch.no_grad():
        full = model(ids, torch.tensor([0]))
        model.reset_buffers()
        last = model(ids, torch.tensor([0]), last_only=True)
    torch.testing.assert_close(last, full[:, -1])


BAD_CONFIGS = {
    "gqa": dict(n_heads=6, n_kv_heads=4),
    "dim": dict(dim=66, n_heads=4),
    "layers": dict(n_layers=0),
    "odd-rope-dim": dict(rope_dim=7),
    "rope-dim-over-head-dim": dict(rope_dim=32),
    "nope-layer-out-of-range": dict(nope_layers=(1,)),
    "window-without-layers": dict(sliding_window=8),
    "layers-without-window": dict(sliding_window_layers=(0,)),
    "zero-window": dict(sliding_window=0, sliding_window_layers=(0,)),
    "local-theta-without-sliding-layers": dict(rope_local_theta=10.0),
    "activation": dict(activation="relu"),
    "attention-scale": dict(attention_scale=0.0),
    "softcap": dict(final_logit_softcap=-1.0),
    "longrope-length": dict(rope_scaling=LongRopeScaling((1.0,) * 3, (1.0,) * 3, 16, 1.0)),
}


@pytest.mark.parametrize("bad", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_config_rejects_inconsistent_shapes(bad):
    base = dict(vocab_size=10, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=32)
    with pytest.raises(ValueError):
        DecoderConfig(**{**base, **bad})


def test_config_round_trips_through_a_manifest():
    """`genai eval` rebuilds random-weight models from the manifest's JSON config."""
    import dataclasses
    import json

    from genai_pipeline.registry import SPECS

    for spec in SPECS.values():
        data = json.loads(json.dumps(dataclasses.asdict(spec.config)))
        assert DecoderConfig.from_dict(data) == spec.config, spec.name


@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("shape", [(1, 7, 64), (1, 7, 4, 16)], ids=["hidden", "per-head"])
def test_norm_mean_by_matmul_equals_the_mean(shape, unit_offset):
    """The XNNPACK form of RMSNorm (mean of squares as a product with a row of 1/dim)."""
    from genai_pipeline.models.decoder import RMSNorm

    norm = RMSNorm(shape[-1], 1e-6, unit_offset)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(shape) * 3
    with torch.no_grad():
        plain = norm(x)
        norm.mean_by_matmul()
        torch.testing.assert_close(norm(x), plain, rtol=1e-6, atol=1e-6)


def test_tied_head_is_its_own_graph_input_over_the_same_storage(tmp_path):
    """A tied head and the embedding lookup are two graph inputs over one table, so lowering a
    delegated head beside a portable lookup copies nothing (see Decoder.tie_weights)."""
    from genai_pipeline.checkpoints import load_decoder
    from genai_pipeline.prepare.text import DecoderGraph
    from genai_pipeline.registry import get_spec

    save_hf_checkpoint(tmp_path, tie_word_embeddings=True)
    model = load_decoder(get_spec("smollm2-135m"), tmp_path, 32)
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    program = torch.export.export(
        DecoderGraph(model, last_only=True), (torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]))
    )
    inputs = {s.target for s in program.graph_signature.input_specs if s.kind.name == "PARAMETER"}
    assert {"decoder.output.weight", "decoder.tok_embeddings.weight"} <= inputs
    state = program.state_dict
    assert state["decoder.output.weight"].data_ptr() == state["decoder.tok_embeddings.weight"].data_ptr()


def prefill_then_step(model, ids: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The logits of `ids` prefilled from position 0, then of one decode step, from empty caches."""
    model.reset_buffers()
    return torch.cat([model(ids, torch.tensor([0])), model(step, torch.tensor([ids.shape[1]]))], dim=1)


@pytest.mark.parametrize("rope_dim", [16, 8], ids=["full", "partial"])
def test_rope_half_swap_by_matmul_computes_the_same(tiny_eager, rope_dim):
    """XNNPACK graphs' RoPE (Decoder.swap_rope_halves_by_matmul: no slices, which XNNPACK does not
    delegate in a dynamic-length graph) is the slices' RoPE, bit for bit: one +-1 per row."""
    from genai_pipeline.models.decoder import Decoder

    torch.manual_seed(0)
    config = dataclasses.replace(tiny_eager().config, rope_dim=rope_dim)
    model = Decoder(config, TINY_MAX_SEQ)
    ids, step = torch.randint(0, TINY_VOCAB, (1, 9)), torch.tensor([[3]])
    with torch.no_grad():
        before = prefill_then_step(model, ids, step)
        model.swap_rope_halves_by_matmul()
        after = prefill_then_step(model, ids, step)
    assert model.rope_swap.shape == (rope_dim, rope_dim)
    assert torch.equal(after, before)


@pytest.mark.parametrize(
    "recipe, change, fused",
    [
        ("fp32", {}, "qkv"),
        ("fp32", {"qkv_bias": True}, "qkv"),
        ("8da8w", {"qkv_bias": True}, "qkv"),
        ("fp32", {"qk_norm": True}, "qkv"),  # q and k normed per head before RoPE: rotated apart
        ("8da4w", {}, "qk"),  # the default keeps wv at 8 bits: it cannot share the 4-bit kernel
    ],
)
def test_fused_projections_compute_the_same(tiny_eager, recipe, change, fused):
    """XNNPACK's lowering fuses the linears that read one input (targets/xnnpack.py), and RoPE
    rotates q and k as one tensor: the same logits, prefill then a decode step."""
    from genai_pipeline.models.decoder import Decoder
    from genai_pipeline.options import QuantOptions
    from genai_pipeline.quantize.recipes import quantize_module
    from genai_pipeline.quantize.weights import concat_rows

    torch.manual_seed(0)
    model = tiny_eager()
    if change:
        model = Decoder(dataclasses.replace(model.config, **change), TINY_MAX_SEQ)
    if recipe != "fp32":
        quantize_module(model, QuantOptions(recipe=recipe, weight_rule="mse", rotate=False, smooth=None))
    ids, step = torch.randint(0, TINY_VOCAB, (1, 9)), torch.tensor([[3]])
    with torch.no_grad():
        before = prefill_then_step(model, ids, step)
        model.fuse_projections(concat_rows)
        model.fuse_projections(concat_rows)  # prefill and decode share the module: a second call is a no-op
        after = prefill_then_step(model, ids, step)
    attention, ffn = model.layers[0].attention, model.layers[0].feed_forward
    head_dim = model.config.head_dim
    n_q, n_kv = model.config.n_heads * head_dim, model.config.n_kv_heads * head_dim
    assert attention.fused.out_features == n_q + n_kv * (2 if fused == "qkv" else 1)
    assert (attention.wv is None) == (fused == "qkv") and attention.wq is None and attention.wk is None
    assert ffn.w13 is not None and ffn.w1 is None and ffn.w3 is None
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_v_is_projected_first(tiny_eager):
    """The exported graph runs in the order of the eager calls: v before q and k (docs/decisions/0018:
    an 8-bit v last slows the attention at 2 threads)."""
    model, order = tiny_eager(), []
    attention = model.layers[0].attention
    for name in ("wq", "wk", "wv"):
        getattr(attention, name).register_forward_hook(lambda *_, name=name: order.append(name))
    with torch.no_grad():
        model(torch.tensor([[1, 2]]), torch.tensor([0]))
    assert order == ["wv", "wq", "wk"]
