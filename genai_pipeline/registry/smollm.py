"""SmolLM3: the Llama decoder without RoPE in every fourth layer (`no_rope_layers`: 1 = RoPE, 0 = none).

(SmolLM2 is a plain `LlamaForCausalLM`: see llama.py.) Sizes are those of the public config.json.
"""

from __future__ import annotations

import genai_pipeline.registry.chat_templates as chat_templates
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.registry.hf_config import decoder_fields, rope_fields, sliding_window_fields
from genai_pipeline.registry.llama import HF_KEY_MAP
from genai_pipeline.registry.spec import ModelSpec


def nope_layers_from_hf(hf: dict) -> tuple[int, ...]:
    """Layers without RoPE. transformers' default, when `no_rope_layers` is absent: every
    `no_rope_layer_interval`-th layer (4 by default) has none."""
    n_layers = int(hf["num_hidden_layers"])
    interval = int(hf.get("no_rope_layer_interval", 4))
    use_rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n_layers)]
    if len(use_rope) != n_layers:
        raise ValueError(f"no_rope_layers has {len(use_rope)} entries for {n_layers} layers")
    return tuple(i for i, flag in enumerate(use_rope) if not flag)


def smollm3_config_from_hf(hf: dict) -> DecoderConfig:
    return DecoderConfig(
        **decoder_fields(hf, tie_default=True),
        **rope_fields(hf),
        **sliding_window_fields(hf),
        qkv_bias=bool(hf.get("attention_bias", False)),
        nope_layers=nope_layers_from_hf(hf),
    )


SPECS = (
    ModelSpec(
        name="smollm3-3b",
        family="smollm3",
        description="HuggingFaceTB/SmolLM3-3B",
        config=DecoderConfig(
            vocab_size=128256,
            dim=2048,
            n_layers=36,
            n_heads=16,
            n_kv_heads=4,
            hidden_dim=11008,
            norm_eps=1e-6,
            rope_theta=5000000.0,
            tie_embeddings=True,
            max_position_embeddings=65536,
            nope_layers=tuple(range(3, 36, 4)),
        ),
        key_map=HF_KEY_MAP,
        config_from_checkpoint=smollm3_config_from_hf,
        hf_model_types=("smollm3",),
        bos_id=None,  # its tokenizer adds no BOS
        eos_ids=(128012, 128001),  # <|im_end|>, <|end_of_text|>
        chat_template=chat_templates.CHATML,
    ),
)
