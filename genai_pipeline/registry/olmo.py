"""AI2's OLMo 2 (`Olmo2ForCausalLM`, model_type `olmo2`): the Llama decoder with its norms moved.

No norm before attention or the MLP; an RMSNorm after each, before the residual add
(`post_attention_layernorm`, `post_feedforward_layernorm`); q and k RMSNorm'd over the whole
projection (all heads at once) before RoPE. Sizes are those of the public config.json.
"""

from __future__ import annotations

import genai_pipeline.registry.chat_templates as chat_templates
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.registry.hf_config import decoder_fields, rope_fields, unsupported
from genai_pipeline.registry.llama import HF_KEY_MAP
from genai_pipeline.registry.spec import ModelSpec

# OLMo 2's two norms come after attention and the MLP; listed first because the first match wins
# and Llama's `post_attention_layernorm` is the norm *before* the MLP.
OLMO2_KEY_MAP: tuple[tuple[str, str], ...] = (
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.attention_post_norm.weight"),
    (r"model\.layers\.(\d+)\.post_feedforward_layernorm\.weight", r"layers.\1.ffn_post_norm.weight"),
) + HF_KEY_MAP


def olmo2_config_from_hf(hf: dict) -> DecoderConfig:
    if hf.get("sliding_window"):  # llama.cpp writes OLMo 3 as olmo2 with a window
        raise unsupported("a sliding window in an OLMo 2 model (OLMo 3's layout)")
    return DecoderConfig(
        **decoder_fields(hf),
        **rope_fields(hf),
        qkv_bias=bool(hf.get("attention_bias", False)),
        pre_norms=False,
        sandwich_norms=True,
        qk_norm=True,
        qk_norm_across_heads=True,
    )


SPECS = (
    ModelSpec(
        name="olmo2-1b",
        family="olmo2",
        description="allenai/OLMo-2-0425-1B",
        config=DecoderConfig(
            vocab_size=100352,
            dim=2048,
            n_layers=16,
            n_heads=16,
            n_kv_heads=16,
            hidden_dim=8192,
            norm_eps=1e-6,
            rope_theta=500000.0,
            pre_norms=False,
            sandwich_norms=True,
            qk_norm=True,
            qk_norm_across_heads=True,
            max_position_embeddings=4096,
        ),
        key_map=OLMO2_KEY_MAP,
        config_from_checkpoint=olmo2_config_from_hf,
        hf_model_types=("olmo2",),
        bos_id=100257,  # <|endoftext|>
        eos_ids=(100257,),
        chat_template=chat_templates.TULU,
    ),
)
