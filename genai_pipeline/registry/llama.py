"""Llama family: Llama 3.x, SmolLM2 and the shipped reference model (all `LlamaForCausalLM`).

Sizes are those of the public config.json files."""

from __future__ import annotations

from pathlib import Path

import genai_pipeline.registry.chat_templates as chat_templates
from genai_pipeline.models.decoder import DecoderConfig, RopeScaling
from genai_pipeline.registry.hf_config import decoder_fields, rope_fields
from genai_pipeline.registry.spec import ModelSpec

ASSETS = Path(__file__).resolve().parents[2] / "assets"

# Hugging Face `LlamaForCausalLM` tensor names -> ours.
HF_KEY_MAP: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", "tok_embeddings.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", r"layers.\1.attention.wq.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", r"layers.\1.attention.wk.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", r"layers.\1.attention.wv.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"layers.\1.attention.wo.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", r"layers.\1.attention.q_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", r"layers.\1.attention.k_norm.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", r"layers.\1.feed_forward.w1.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"layers.\1.feed_forward.w2.weight"),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", r"layers.\1.feed_forward.w3.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.attention_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.ffn_norm.weight"),
)


def config_from_hf(hf: dict) -> DecoderConfig:
    """A Hugging Face LlamaConfig (as a dict from config.json) as our DecoderConfig."""
    return DecoderConfig(**decoder_fields(hf), **rope_fields(hf), qkv_bias=bool(hf.get("attention_bias", False)))


def _llama3_rope(factor: float) -> RopeScaling:
    return RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def _spec(
    name: str, description: str, config: DecoderConfig, bos: int, eos: tuple[int, ...], checkpoint=None, chat=None
):
    return ModelSpec(
        name=name,
        family="llama",
        description=description,
        config=config,
        key_map=HF_KEY_MAP,
        config_from_checkpoint=config_from_hf,
        hf_model_types=("llama",),
        bos_id=bos,
        eos_ids=eos,
        checkpoint=checkpoint,
        chat_template=chat,
    )


SPECS = (
    _spec(
        "reference",
        "shipped reference model, trained by tools/train_reference.py on Python's own docs",
        DecoderConfig(
            vocab_size=4096,
            dim=256,
            n_layers=4,
            n_heads=8,
            n_kv_heads=4,
            hidden_dim=768,
            tie_embeddings=True,
            max_position_embeddings=512,
        ),
        bos=0,
        eos=(0,),
        checkpoint=ASSETS / "reference",
    ),
    _spec(
        "smollm2-135m",
        "HuggingFaceTB/SmolLM2-135M",
        DecoderConfig(
            vocab_size=49152,
            dim=576,
            n_layers=30,
            n_heads=9,
            n_kv_heads=3,
            hidden_dim=1536,
            rope_theta=100000.0,
            tie_embeddings=True,
            max_position_embeddings=8192,
        ),
        bos=0,
        eos=(0,),
        chat=chat_templates.CHATML,
    ),
    _spec(
        "smollm2-360m",
        "HuggingFaceTB/SmolLM2-360M",
        DecoderConfig(
            vocab_size=49152,
            dim=960,
            n_layers=32,
            n_heads=15,
            n_kv_heads=5,
            hidden_dim=2560,
            rope_theta=100000.0,
            tie_embeddings=True,
            max_position_embeddings=8192,
        ),
        bos=0,
        eos=(0,),
        chat=chat_templates.CHATML,
    ),
    _spec(
        "smollm2-1_7b",
        "HuggingFaceTB/SmolLM2-1.7B",
        DecoderConfig(
            vocab_size=49152,
            dim=2048,
            n_layers=24,
            n_heads=32,
            n_kv_heads=32,
            hidden_dim=8192,
            rope_theta=130000.0,
            tie_embeddings=True,
            max_position_embeddings=8192,
        ),
        bos=0,
        eos=(0,),
        chat=chat_templates.CHATML,
    ),
    _spec(
        "llama3_2-1b",
        "meta-llama/Llama-3.2-1B",
        DecoderConfig(
            vocab_size=128256,
            dim=2048,
            n_layers=16,
            n_heads=32,
            n_kv_heads=8,
            hidden_dim=8192,
            norm_eps=1e-5,
            rope_theta=500000.0,
            tie_embeddings=True,
            max_position_embeddings=131072,
            rope_scaling=_llama3_rope(32.0),
        ),
        bos=128000,
        eos=(128001, 128008, 128009),
        chat=chat_templates.LLAMA3,
    ),
    _spec(
        "llama3_2-3b",
        "meta-llama/Llama-3.2-3B",
        DecoderConfig(
            vocab_size=128256,
            dim=3072,
            n_layers=28,
            n_heads=24,
            n_kv_heads=8,
            hidden_dim=8192,
            head_dim=128,
            norm_eps=1e-5,
            rope_theta=500000.0,
            tie_embeddings=True,
            max_position_embeddings=131072,
            rope_scaling=_llama3_rope(32.0),
        ),
        bos=128000,
        eos=(128001, 128008, 128009),
        chat=chat_templates.LLAMA3,
    ),
    _spec(
        "llama3_1-8b",
        "meta-llama/Llama-3.1-8B",
        DecoderConfig(
            vocab_size=128256,
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            hidden_dim=14336,
            norm_eps=1e-5,
            rope_theta=500000.0,
            tie_embeddings=False,
            max_position_embeddings=131072,
            rope_scaling=_llama3_rope(8.0),
        ),
        bos=128000,
        eos=(128001, 128008, 128009),
        chat=chat_templates.LLAMA3,
    ),
)
