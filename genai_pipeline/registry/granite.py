"""IBM Granite 3.x (`GraniteForCausalLM`, model_type `granite`): the Llama decoder with four scalars.

Token embeddings times `embedding_multiplier`, each attention and MLP output times
`residual_multiplier` before the residual add, attention scaled by `attention_multiplier` (not
1 / sqrt(head_dim)), logits divided by `logits_scaling`. Sizes are those of the public config.json.
"""

from __future__ import annotations

import genai_pipeline.registry.chat_templates as chat_templates
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.registry.hf_config import decoder_fields, rope_fields, unsupported
from genai_pipeline.registry.llama import HF_KEY_MAP
from genai_pipeline.registry.spec import ModelSpec


def granite_config_from_hf(hf: dict) -> DecoderConfig:
    if hf.get("mlp_bias"):
        raise unsupported("MLP biases (mlp_bias)")
    return DecoderConfig(
        **decoder_fields(hf),
        **rope_fields(hf),
        qkv_bias=bool(hf.get("attention_bias", False)),
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        attention_scale=float(hf.get("attention_multiplier", 1.0)),
        logit_divisor=float(hf.get("logits_scaling", 1.0)),
    )


SPECS = (
    ModelSpec(
        name="granite3_3-2b",
        family="granite",
        description="ibm-granite/granite-3.3-2b-instruct",
        config=DecoderConfig(
            vocab_size=49159,
            dim=2048,
            n_layers=40,
            n_heads=32,
            n_kv_heads=8,
            hidden_dim=8192,
            norm_eps=1e-5,
            rope_theta=10000000.0,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_scale=0.015625,
            logit_divisor=8.0,
            tie_embeddings=True,
            max_position_embeddings=131072,
        ),
        key_map=HF_KEY_MAP,
        config_from_checkpoint=granite_config_from_hf,
        hf_model_types=("granite",),
        bos_id=None,  # its tokenizer adds no BOS
        eos_ids=(0,),  # <|end_of_text|>
        chat_template=chat_templates.GRANITE,
    ),
)
