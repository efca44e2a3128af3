"""Gemma 3 text models (`Gemma3ForCausalLM`, model_type `gemma3_text`).

The one decoder with Gemma's switches: embeddings scaled by sqrt(hidden_size), GeGLU (tanh GeLU)
MLP, RMSNorm with (1 + weight), norms before AND after attention and MLP, QK-norm, attention
scaled by query_pre_attn_scalar, and sliding-window layers (5 of every 6) with their own RoPE
base. Sizes are those of the public config.json.
"""

from __future__ import annotations

import genai_pipeline.registry.chat_templates as chat_templates
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.registry.hf_config import decoder_fields, rope_fields, sliding_window_fields, unsupported
from genai_pipeline.registry.llama import HF_KEY_MAP
from genai_pipeline.registry.spec import ModelSpec

# Gemma's four norms per block; listed first because the first match wins and Llama's
# `post_attention_layernorm` is the norm *before* the MLP.
GEMMA3_KEY_MAP: tuple[tuple[str, str], ...] = (
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attention_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.attention_post_norm.weight"),
    (r"model\.layers\.(\d+)\.pre_feedforward_layernorm\.weight", r"layers.\1.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_feedforward_layernorm\.weight", r"layers.\1.ffn_post_norm.weight"),
) + HF_KEY_MAP


def _rope_parameters(hf: dict) -> tuple[dict, float]:
    """(RoPE parameters of the global layers, RoPE base of the sliding-window layers), from the
    5.x layout (nested by layer type) or the 4.x one (`rope_theta`, `rope_local_base_freq`)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        return params["full_attention"], float(params["sliding_attention"]["rope_theta"])
    return {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1000000.0)}, float(
        hf.get("rope_local_base_freq", 10000.0)
    )


def gemma3_config_from_hf(hf: dict) -> DecoderConfig:
    if hf.get("attn_logit_softcapping") is not None:
        raise unsupported("attention logit softcapping (ExecuTorch's custom_sdpa has none)")
    if hf.get("use_bidirectional_attention"):
        raise unsupported("bidirectional attention")
    global_rope, local_theta = _rope_parameters(hf)
    sliding = sliding_window_fields(hf)
    return DecoderConfig(
        **decoder_fields(hf, tie_default=True),
        **rope_fields(hf, global_rope),
        **sliding,
        rope_local_theta=local_theta if sliding else None,
        qkv_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True,
        norm_unit_offset=True,
        sandwich_norms=True,
        scale_embeddings=True,
        attention_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcap=hf.get("final_logit_softcapping"),
    )


SPECS = (
    ModelSpec(
        name="gemma3-1b",
        family="gemma3",
        description="google/gemma-3-1b-pt",
        config=DecoderConfig(
            vocab_size=262144,
            dim=1152,
            n_layers=26,
            n_heads=4,
            n_kv_heads=1,
            hidden_dim=6912,
            head_dim=256,
            norm_eps=1e-6,
            norm_unit_offset=True,
            sandwich_norms=True,
            rope_theta=1000000.0,
            rope_local_theta=10000.0,
            sliding_window=512,
            sliding_window_layers=tuple(i for i in range(26) if (i + 1) % 6),
            qk_norm=True,
            attention_scale=256**-0.5,
            activation="gelu_tanh",
            scale_embeddings=True,
            tie_embeddings=True,
            max_position_embeddings=32768,
        ),
        key_map=GEMMA3_KEY_MAP,
        config_from_checkpoint=gemma3_config_from_hf,
        hf_model_types=("gemma3_text",),
        bos_id=2,  # <bos>
        eos_ids=(1, 106),  # <eos>, <end_of_turn>
        chat_template=chat_templates.GEMMA,
    ),
)
