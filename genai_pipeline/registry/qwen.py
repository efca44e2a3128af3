"""Qwen 2.5 (q/k/v biases) and Qwen 3 (per-head QK-norm): the Llama decoder with two switches."""

from __future__ import annotations

import dataclasses

from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.registry import ModelSpec
from genai_pipeline.registry.llama import HF_KEY_MAP, config_from_hf


def qwen2_config_from_hf(hf: dict) -> DecoderConfig:
    return dataclasses.replace(config_from_hf(hf), qkv_bias=True)


def qwen3_config_from_hf(hf: dict) -> DecoderConfig:
    return dataclasses.replace(config_from_hf(hf), qk_norm=True)


SPECS = (
    ModelSpec(
        name="qwen2_5-0_5b",
        family="qwen2",
        description="Qwen/Qwen2.5-0.5B",
        config=DecoderConfig(
            vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, hidden_dim=4864,
            norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True, tie_embeddings=True, max_position_embeddings=32768,
        ),
        key_map=HF_KEY_MAP,
        config_from_hf=qwen2_config_from_hf,
        hf_model_types=("qwen2",),
        bos_id=None,
        eos_ids=(151643, 151645),
    ),
    ModelSpec(
        name="qwen3-0_6b",
        family="qwen3",
        description="Qwen/Qwen3-0.6B",
        config=DecoderConfig(
            vocab_size=151936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, hidden_dim=3072, head_dim=128,
            norm_eps=1e-6, rope_theta=1000000.0, qk_norm=True, tie_embeddings=True, max_position_embeddings=40960,
        ),
        key_map=HF_KEY_MAP,
        config_from_hf=qwen3_config_from_hf,
        hf_model_types=("qwen3",),
        bos_id=None,
        eos_ids=(151643, 151645),
    ),
)
