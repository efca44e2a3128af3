"""Liquid AI's LFM2 (`Lfm2ForCausalLM`, model_type `lfm2`): a hybrid of gated short-convolution
blocks and GQA attention blocks (per-head QK-norm), each followed by a SwiGLU MLP.

The layers listed as "conv" in `layer_types` (older configs: all but `full_attn_idxs`) are the
decoder's `conv_layers`; their state is a cache in the program like the KV cache. The MLP's width
is transformers' adjustment of `intermediate_size` (`block_ff_dim` in the Hub's files). Sizes are
those of the public config.json.
"""

from __future__ import annotations

import genai_pipeline.registry.chat_templates as chat_templates
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.registry.hf_config import decoder_fields, rope_fields, unsupported
from genai_pipeline.registry.spec import ModelSpec

LFM2_KEY_MAP: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", "tok_embeddings.weight"),
    (r"model\.embedding_norm\.weight", "norm.weight"),  # the final norm, despite its name
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.operator_norm\.weight", r"layers.\1.attention_norm.weight"),
    (r"model\.layers\.(\d+)\.ffn_norm\.weight", r"layers.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", r"layers.\1.attention.wq.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", r"layers.\1.attention.wk.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", r"layers.\1.attention.wv.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.out_proj\.weight", r"layers.\1.attention.wo.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_layernorm\.weight", r"layers.\1.attention.q_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_layernorm\.weight", r"layers.\1.attention.k_norm.weight"),
    (r"model\.layers\.(\d+)\.conv\.in_proj\.weight", r"layers.\1.conv.in_proj.weight"),
    (r"model\.layers\.(\d+)\.conv\.out_proj\.weight", r"layers.\1.conv.out_proj.weight"),
    (r"model\.layers\.(\d+)\.conv\.conv\.weight", r"layers.\1.conv.conv_weight"),
    (r"model\.layers\.(\d+)\.feed_forward\.(w1|w2|w3)\.weight", r"layers.\1.feed_forward.\2.weight"),
)


def mlp_width(hf: dict) -> int:
    """transformers' Lfm2MLP: 2/3 of the configured width, times the multiplier, rounded up to a
    multiple of `block_multiple_of`."""
    width = int(hf.get("block_ff_dim") or hf["intermediate_size"])
    if hf.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        if hf.get("block_ffn_dim_multiplier", 1.0) is not None:
            width = int(hf.get("block_ffn_dim_multiplier", 1.0) * width)
            multiple = int(hf.get("block_multiple_of", 256))
            width = multiple * ((width + multiple - 1) // multiple)
    return width


def conv_layers_from_hf(hf: dict) -> tuple[int, ...]:
    n_layers = int(hf["num_hidden_layers"])
    kinds = hf.get("layer_types")
    if kinds is None:
        attention = hf.get("full_attn_idxs")
        attention = range(n_layers) if attention is None else attention
        kinds = ["full_attention" if i in attention else "conv" for i in range(n_layers)]
    if len(kinds) != n_layers or set(kinds) - {"conv", "full_attention"}:
        raise ValueError(f"layer_types must name {n_layers} layers 'conv' or 'full_attention', got {kinds}")
    return tuple(i for i, kind in enumerate(kinds) if kind == "conv")


def lfm2_config_from_hf(hf: dict) -> DecoderConfig:
    if hf.get("conv_bias"):
        raise unsupported("convolution biases (conv_bias)")
    hf = {
        **hf,
        "intermediate_size": mlp_width(hf),
        "rms_norm_eps": hf.get("norm_eps", 1e-5),
        "tie_word_embeddings": hf.get("tie_embedding", hf.get("tie_word_embeddings", True)),
    }
    return DecoderConfig(
        **decoder_fields(hf, tie_default=True),
        **rope_fields(hf),
        qk_norm=True,
        conv_layers=conv_layers_from_hf(hf),
        conv_kernel=int(hf.get("conv_L_cache", 3)),
    )


SPECS = (
    ModelSpec(
        name="lfm2-350m",
        family="lfm2",
        description="LiquidAI/LFM2-350M",
        config=DecoderConfig(
            vocab_size=65536,
            dim=1024,
            n_layers=16,
            n_heads=16,
            n_kv_heads=8,
            hidden_dim=4608,
            norm_eps=1e-5,
            rope_theta=1000000.0,
            qk_norm=True,
            conv_layers=(0, 1, 3, 4, 6, 7, 9, 11, 13, 15),
            conv_kernel=3,
            tie_embeddings=True,
            max_position_embeddings=128000,
        ),
        key_map=LFM2_KEY_MAP,
        config_from_checkpoint=lfm2_config_from_hf,
        hf_model_types=("lfm2",),
        bos_id=1,  # <|startoftext|>
        eos_ids=(7, 2),  # <|im_end|>, <|endoftext|>
        chat_template=chat_templates.LFM2,
    ),
)
