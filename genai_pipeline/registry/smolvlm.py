"""SmolVLM / Idefics3: a SigLIP image tower, a pixel-shuffle + linear connector, and a Llama
(SmolLM2) text decoder (`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`).

Sizes are those of the public config.json and processor files; a checkpoint's own files win.
"""

from __future__ import annotations

import dataclasses

import genai_pipeline.registry.chat_templates as chat_templates
from genai_pipeline.image_processing import ImageProcessing
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.models.vision_config import VisionConfig
from genai_pipeline.registry.hf_config import text_config, unsupported
from genai_pipeline.registry.llama import ASSETS, HF_KEY_MAP, config_from_hf
from genai_pipeline.registry.multimodal import VisionSpec
from genai_pipeline.registry.spec import ModelSpec

# The text decoder's tensors sit under `model.text_model.` (the head stays `lm_head`); ours under `decoder.`.
TEXT_KEY_MAP = tuple(
    (pattern.replace(r"model\.", r"model\.text_model\.", 1), f"decoder.{ours}") for pattern, ours in HF_KEY_MAP
)
VISION_KEY_MAP: tuple[tuple[str, str], ...] = (
    (
        r"model\.vision_model\.embeddings\.(patch_embedding\.(?:weight|bias)|position_embedding\.weight)",
        r"vision.embeddings.\1",
    ),
    (
        r"model\.vision_model\.encoder\.layers\.(\d+)\.self_attn\.((?:q|k|v|out)_proj\.(?:weight|bias))",
        r"vision.layers.\1.self_attn.\2",
    ),
    (r"model\.vision_model\.encoder\.layers\.(\d+)\.(layer_norm[12]\.(?:weight|bias))", r"vision.layers.\1.\2"),
    (r"model\.vision_model\.encoder\.layers\.(\d+)\.mlp\.(fc[12]\.(?:weight|bias))", r"vision.layers.\1.\2"),
    (r"model\.vision_model\.post_layernorm\.(weight|bias)", r"vision.post_layernorm.\1"),
    (r"model\.connector\.modality_projection\.proj\.weight", "vision.projection.weight"),
)
VISION_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def text_config_from_hf(hf: dict) -> DecoderConfig:
    return config_from_hf(text_config(hf))


def vision_config_from_hf(hf: dict) -> VisionConfig:
    """transformers' Idefics3VisionConfig defaults stand in for keys a config.json leaves out."""
    v = hf.get("vision_config") or {}
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in VISION_ACTIVATIONS:
        raise unsupported(f"vision activation '{act}'")
    return VisionConfig(
        image_size=int(v.get("image_size", 224)),
        patch_size=int(v.get("patch_size", 32)),
        dim=int(v.get("hidden_size", 1152)),
        n_layers=int(v.get("num_hidden_layers", 12)),
        n_heads=int(v.get("num_attention_heads", 16)),
        hidden_dim=int(v.get("intermediate_size", 3072)),
        norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        activation=VISION_ACTIVATIONS[act],
        scale_factor=int(hf.get("scale_factor", 2)),
        text_dim=int(hf["text_config"]["hidden_size"]),
    )


def _spec(name: str, description: str, text: DecoderConfig, vision: VisionConfig, longest_edge: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        family="smolvlm",
        description=description,
        config=text,
        key_map=TEXT_KEY_MAP + VISION_KEY_MAP,
        config_from_checkpoint=text_config_from_hf,
        hf_model_types=("idefics3", "smolvlm"),
        bos_id=1,  # <|im_start|>
        eos_ids=(49279,),  # <end_of_utterance>
        vision=VisionSpec(
            config=vision,
            config_from_checkpoint=vision_config_from_hf,
            preprocessing=ImageProcessing(
                tile_size=vision.image_size, longest_edge=longest_edge, tokens_per_image=vision.tokens_per_image
            ),
            image_token_id=49190,
        ),
    )


def _siglip_base(text_dim: int) -> VisionConfig:  # SigLIP base, patch 16, 512 px; 64 tokens per image
    return VisionConfig(
        image_size=512,
        patch_size=16,
        dim=768,
        n_layers=12,
        n_heads=12,
        hidden_dim=3072,
        text_dim=text_dim,
        scale_factor=4,
    )


SPECS = (
    _spec(
        "smolvlm-256m",
        "HuggingFaceTB/SmolVLM-256M-Instruct",
        DecoderConfig(
            vocab_size=49280,
            dim=576,
            n_layers=30,
            n_heads=9,
            n_kv_heads=3,
            hidden_dim=1536,
            rope_theta=100000.0,
            max_position_embeddings=8192,
        ),
        _siglip_base(576),
        longest_edge=2048,
    ),
    _spec(
        "smolvlm-500m",
        "HuggingFaceTB/SmolVLM-500M-Instruct",
        DecoderConfig(
            vocab_size=49280,
            dim=960,
            n_layers=32,
            n_heads=15,
            n_kv_heads=5,
            hidden_dim=2560,
            rope_theta=100000.0,
            max_position_embeddings=8192,
        ),
        _siglip_base(960),
        longest_edge=2048,
    ),
    _spec(
        "smolvlm2-2_2b",
        "HuggingFaceTB/SmolVLM2-2.2B-Instruct",
        DecoderConfig(
            vocab_size=49280,
            dim=2048,
            n_layers=24,
            n_heads=32,
            n_kv_heads=32,
            hidden_dim=8192,
            rope_theta=130000.0,
            max_position_embeddings=8192,
        ),
        # SigLIP so400m, patch 14, 384 px (27 x 27 patches), shuffled by 3: 81 tokens per image
        VisionConfig(
            image_size=384,
            patch_size=14,
            dim=1152,
            n_layers=27,
            n_heads=16,
            hidden_dim=4304,
            text_dim=2048,
            scale_factor=3,
        ),
        longest_edge=1536,
    ),
)


def _reference_vlm() -> ModelSpec:
    """The shipped tiny Idefics3 (tools/train_reference_vlm.py): SigLIP 72 px / patch 12 / width 128 / 3 layers,
    shuffled by 2 (9 tokens per image, one per cell of its 3x3 grid), the text reference's decoder;
    vocabulary 4096 + 3 image tokens."""
    vision = VisionConfig(
        image_size=72, patch_size=12, dim=128, n_layers=3, n_heads=4, hidden_dim=512, text_dim=256, scale_factor=2
    )
    spec = _spec(
        "reference-vlm",
        "shipped tiny vision-language model, trained by tools/train_reference_vlm.py on generated shapes",
        DecoderConfig(
            vocab_size=4099,
            dim=256,
            n_layers=4,
            n_heads=8,
            n_kv_heads=4,
            hidden_dim=768,
            tie_embeddings=True,
            max_position_embeddings=512,
        ),
        vision,
        longest_edge=72,
    )
    processing = dataclasses.replace(spec.vision.preprocessing, do_image_splitting=False)
    return dataclasses.replace(
        spec,
        bos_id=0,
        eos_ids=(0,),
        chat_template=chat_templates.QUESTION_ANSWER,
        checkpoint=ASSETS / "reference-vlm",
        vision=dataclasses.replace(spec.vision, preprocessing=processing, image_token_id=4097),
    )


SPECS = SPECS + (_reference_vlm(),)
