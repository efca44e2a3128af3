"""Qwen 2.5 (q/k/v biases) and Qwen 3 (per-head QK-norm): the Llama decoder with two switches.

Sizes are those of the public config.json files. Qwen3-0.6B, 1.7B and 4B tie their embeddings
(their safetensors still carry an `lm_head.weight` copy, which the Hub's parameter counts include).
"""

from __future__ import annotations

import genai_pipeline.registry.chat_templates as chat_templates
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.registry.hf_config import decoder_fields, rope_fields, sliding_window_fields
from genai_pipeline.registry.llama import HF_KEY_MAP
from genai_pipeline.registry.spec import ModelSpec

QWEN_EOS = (151643, 151645)  # <|endoftext|>, <|im_end|>


def qwen2_config_from_hf(hf: dict) -> DecoderConfig:
    return DecoderConfig(**decoder_fields(hf), **rope_fields(hf), **sliding_window_fields(hf), qkv_bias=True)


def qwen3_config_from_hf(hf: dict) -> DecoderConfig:
    return DecoderConfig(
        **decoder_fields(hf),
        **rope_fields(hf),
        **sliding_window_fields(hf),
        qkv_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True,
    )


def _spec(name: str, description: str, family: str, config: DecoderConfig) -> ModelSpec:
    return ModelSpec(
        name=name,
        family=family,
        description=description,
        config=config,
        key_map=HF_KEY_MAP,
        config_from_checkpoint={"qwen2": qwen2_config_from_hf, "qwen3": qwen3_config_from_hf}[family],
        hf_model_types=(family,),
        bos_id=None,
        eos_ids=QWEN_EOS,
        chat_template=chat_templates.CHATML,
    )


SPECS = (
    _spec(
        "qwen2_5-0_5b",
        "Qwen/Qwen2.5-0.5B",
        "qwen2",
        DecoderConfig(
            vocab_size=151936,
            dim=896,
            n_layers=24,
            n_heads=14,
            n_kv_heads=2,
            hidden_dim=4864,
            norm_eps=1e-6,
            rope_theta=1000000.0,
            qkv_bias=True,
            tie_embeddings=True,
            max_position_embeddings=32768,
        ),
    ),
    _spec(
        "qwen2_5-1_5b",
        "Qwen/Qwen2.5-1.5B",
        "qwen2",
        DecoderConfig(
            vocab_size=151936,
            dim=1536,
            n_layers=28,
            n_heads=12,
            n_kv_heads=2,
            hidden_dim=8960,
            norm_eps=1e-6,
            rope_theta=1000000.0,
            qkv_bias=True,
            tie_embeddings=True,
            max_position_embeddings=131072,
        ),
    ),
    _spec(
        "qwen3-0_6b",
        "Qwen/Qwen3-0.6B",
        "qwen3",
        DecoderConfig(
            vocab_size=151936,
            dim=1024,
            n_layers=28,
            n_heads=16,
            n_kv_heads=8,
            hidden_dim=3072,
            head_dim=128,
            norm_eps=1e-6,
            rope_theta=1000000.0,
            qk_norm=True,
            tie_embeddings=True,
            max_position_embeddings=40960,
        ),
    ),
    _spec(
        "qwen3-1_7b",
        "Qwen/Qwen3-1.7B",
        "qwen3",
        DecoderConfig(
            vocab_size=151936,
            dim=2048,
            n_layers=28,
            n_heads=16,
            n_kv_heads=8,
            hidden_dim=6144,
            head_dim=128,
            norm_eps=1e-6,
            rope_theta=1000000.0,
            qk_norm=True,
            tie_embeddings=True,
            max_position_embeddings=40960,
        ),
    ),
    _spec(
        "qwen3-4b",
        "Qwen/Qwen3-4B",
        "qwen3",
        DecoderConfig(
            vocab_size=151936,
            dim=2560,
            n_layers=36,
            n_heads=32,
            n_kv_heads=8,
            hidden_dim=9728,
            head_dim=128,
            norm_eps=1e-6,
            rope_theta=1000000.0,
            qk_norm=True,
            tie_embeddings=True,
            max_position_embeddings=40960,
        ),
    ),
)
