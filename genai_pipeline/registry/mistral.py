"""Mistral (`MistralForCausalLM`) and Ministral (`MinistralForCausalLM`): the Llama decoder with
sliding-window attention where the config has a window.

Mistral slides in every layer when `sliding_window` is set (Mistral-7B-v0.1: 4096; v0.2 and v0.3:
null); transformers' MistralConfig defaults a config.json without the key to 4096, and so do we.
Ministral names its sliding layers in `layer_types`. A window as long as the program's cache
hides nothing: such a program's layers are plainly causal. Sizes are those of the public config.json.
"""

from __future__ import annotations

import genai_pipeline.registry.chat_templates as chat_templates
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.registry.hf_config import decoder_fields, rope_fields, sliding_window_fields
from genai_pipeline.registry.llama import HF_KEY_MAP
from genai_pipeline.registry.spec import ModelSpec

MISTRAL_DEFAULT_WINDOW = 4096  # transformers' MistralConfig.sliding_window


def mistral_config_from_hf(hf: dict) -> DecoderConfig:
    if hf.get("model_type") == "mistral" and "sliding_window" not in hf:
        hf = {**hf, "sliding_window": MISTRAL_DEFAULT_WINDOW}
    return DecoderConfig(**decoder_fields(hf), **rope_fields(hf), **sliding_window_fields(hf))


def _spec(name: str, description: str, config: DecoderConfig) -> ModelSpec:
    return ModelSpec(
        name=name,
        family="mistral",
        description=description,
        config=config,
        key_map=HF_KEY_MAP,
        config_from_checkpoint=mistral_config_from_hf,
        hf_model_types=("mistral", "ministral"),
        bos_id=1,  # <s>
        eos_ids=(2,),  # </s>
        chat_template=chat_templates.MISTRAL,
    )


SPECS = (
    _spec(
        "mistral-7b-v0_3",
        "mistralai/Mistral-7B-v0.3",
        DecoderConfig(
            vocab_size=32768,
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            hidden_dim=14336,
            norm_eps=1e-5,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
        ),
    ),
    _spec(
        "ministral-8b",
        "mistralai/Ministral-8B-Instruct-2410",
        DecoderConfig(
            vocab_size=131072,
            dim=4096,
            n_layers=36,
            n_heads=32,
            n_kv_heads=8,
            hidden_dim=12288,
            head_dim=128,
            norm_eps=1e-5,
            rope_theta=100000000.0,
            sliding_window=32768,
            sliding_window_layers=tuple(range(36)),
            max_position_embeddings=32768,
        ),
    ),
)
