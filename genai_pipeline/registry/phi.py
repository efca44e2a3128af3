"""Phi-3 / Phi-4-mini (`Phi3ForCausalLM`): the Llama decoder with partial rotary embeddings and
LongRoPE, from a checkpoint whose q/k/v and gate/up projections are fused.

The loader splits the fused tensors (`fused_key_map`), so the decoder keeps separate wq/wk/wv and
w1/w3. Sizes and RoPE factors are those of the public config.json.
"""

from __future__ import annotations

import math

import genai_pipeline.registry.chat_templates as chat_templates
from genai_pipeline.models.decoder import DecoderConfig, LongRopeScaling
from genai_pipeline.registry.hf_config import decoder_fields, rope_fields, sliding_window_fields
from genai_pipeline.registry.llama import HF_KEY_MAP
from genai_pipeline.registry.spec import ModelSpec

# qkv_proj = [q_proj; k_proj; v_proj] and gate_up_proj = [gate_proj; up_proj], along the output dim.
PHI3_FUSED_KEY_MAP: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.weight",
        (r"layers.\1.attention.wq.weight", r"layers.\1.attention.wk.weight", r"layers.\1.attention.wv.weight"),
    ),
    (
        r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight",
        (r"layers.\1.feed_forward.w1.weight", r"layers.\1.feed_forward.w3.weight"),
    ),
)


def phi3_config_from_hf(hf: dict) -> DecoderConfig:
    # Phi-3 has no q/k/v biases whatever `attention_bias` says; its window (if any) covers every layer.
    return DecoderConfig(**decoder_fields(hf), **rope_fields(hf), **sliding_window_fields(hf))


# microsoft/Phi-4-mini-instruct, config.json `rope_scaling` (48 = 128 * 0.75 / 2 frequencies)
PHI4_MINI_ROPE = LongRopeScaling(
    short_factor=(1.0,) * 48,
    long_factor=(
        1.0,
        1.118320672,
        1.250641126,
        1.398617824,
        1.564103225,
        1.74916897,
        1.956131817,
        2.187582649,
        2.446418898,
        2.735880826,
        3.059592084,
        3.421605075,
        3.826451687,
        4.279200023,
        4.785517845,
        5.351743533,
        5.984965424,
        6.693110555,
        7.485043894,
        8.370679318,
        9.36110372,
        10.4687158,
        11.70738129,
        13.09260651,
        14.64173252,
        16.37415215,
        18.31155283,
        20.47818807,
        22.90118105,
        25.61086418,
        28.64115884,
        32.03,
        32.1,
        32.13,
        32.23,
        32.6,
        32.61,
        32.64,
        32.66,
        32.7,
        32.71,
        32.93,
        32.97,
        33.28,
        33.49,
        33.5,
        44.16,
        47.77,
    ),
    original_max_position_embeddings=4096,
    attention_factor=math.sqrt(1 + math.log(131072 / 4096) / math.log(4096)),
)

SPECS = (
    ModelSpec(
        name="phi_4_mini",
        family="phi3",
        description="microsoft/Phi-4-mini-instruct",
        config=DecoderConfig(
            vocab_size=200064,
            dim=3072,
            n_layers=32,
            n_heads=24,
            n_kv_heads=8,
            hidden_dim=8192,
            norm_eps=1e-5,
            rope_theta=10000.0,
            rope_scaling=PHI4_MINI_ROPE,
            rope_dim=96,
            sliding_window=262144,
            sliding_window_layers=tuple(range(32)),
            tie_embeddings=True,
            max_position_embeddings=131072,
        ),
        key_map=HF_KEY_MAP,
        fused_key_map=PHI3_FUSED_KEY_MAP,
        config_from_checkpoint=phi3_config_from_hf,
        hf_model_types=("phi3",),
        bos_id=199999,  # <|endoftext|>
        eos_ids=(200020, 199999),  # <|end|>, <|endoftext|>
        chat_template=chat_templates.PHI,
    ),
)
