"""Gemma 3 with images (`Gemma3ForConditionalGeneration`, model_type `gemma3`): a SigLIP tower at
896 px whose 64 x 64 patch features are average-pooled into 16 x 16 tokens, Gemma's RMSNorm and a
bias-free projection, and the Gemma 3 text decoder (registry/gemma.py), in which the tokens of one
image see each other both ways in prefill.

Sizes are those of google/gemma-3-4b-it: its config.json states only what differs from
transformers' defaults (Gemma3TextConfig, SiglipVisionConfig), which fill the rest as they do in
transformers. The entry was written from transformers' Gemma3 code and documentation; the Hub was not
reachable here to check the published files. A checkpoint's own files win.
"""

from __future__ import annotations

import math

import genai_pipeline.registry.chat_templates as chat_templates
from genai_pipeline.image_processing import ImageProcessing
from genai_pipeline.models.decoder import DecoderConfig, LinearRopeScaling
from genai_pipeline.models.vision_config import VisionConfig
from genai_pipeline.registry.gemma import GEMMA3_KEY_MAP, gemma3_config_from_hf
from genai_pipeline.registry.hf_config import text_config, unsupported
from genai_pipeline.registry.multimodal import VisionSpec, composite_text_key_map
from genai_pipeline.registry.spec import ModelSpec

BILINEAR = 2  # PIL.Image.Resampling.BILINEAR: Gemma3ImageProcessor's
VISION_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}

TEXT_KEY_MAP = composite_text_key_map(GEMMA3_KEY_MAP)
_TOWER = r"(?:model\.)?vision_tower\.(?:vision_model\.)?"
_PROJECTOR = r"(?:model\.)?multi_modal_projector\."
VISION_KEY_MAP: tuple[tuple[str, str], ...] = (
    (
        _TOWER + r"embeddings\.(patch_embedding\.(?:weight|bias)|position_embedding\.weight)",
        r"vision.embeddings.\1",
    ),
    (
        _TOWER + r"encoder\.layers\.(\d+)\.self_attn\.((?:q|k|v|out)_proj\.(?:weight|bias))",
        r"vision.layers.\1.self_attn.\2",
    ),
    (_TOWER + r"encoder\.layers\.(\d+)\.(layer_norm[12]\.(?:weight|bias))", r"vision.layers.\1.\2"),
    (_TOWER + r"encoder\.layers\.(\d+)\.mlp\.(fc[12]\.(?:weight|bias))", r"vision.layers.\1.\2"),
    (_TOWER + r"post_layernorm\.(weight|bias)", r"vision.post_layernorm.\1"),
    (_PROJECTOR + r"mm_soft_emb_norm\.weight", "vision.projection.norm.weight"),
    (_PROJECTOR + r"mm_input_projection_weight", "vision.projection.linear.weight"),
)
# stored [vision width, text width] (a matmul's right operand); ours is nn.Linear's [out, in]
TRANSPOSED = (_PROJECTOR + r"mm_input_projection_weight",)


# transformers' Gemma3TextConfig defaults: google's config.json states only what differs from them
TEXT_DEFAULTS = dict(
    vocab_size=262208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    query_pre_attn_scalar=256,
    sliding_window=4096,
)


def text_config_from_hf(hf: dict) -> DecoderConfig:
    text = {**TEXT_DEFAULTS, **text_config(hf)}
    if not text.get("layer_types") and not text.get("sliding_window_pattern"):
        text["sliding_window_pattern"] = 6  # every 6th layer global, as Gemma3TextConfig lays them out
    return gemma3_config_from_hf(text)


def vision_config_from_hf(hf: dict) -> VisionConfig:
    """transformers' SiglipVisionConfig defaults stand in for keys a config.json leaves out."""
    v = hf.get("vision_config") or {}
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in VISION_ACTIVATIONS:
        raise unsupported(f"vision activation '{act}'")
    if v.get("vision_use_head", True):  # SiglipVisionConfig's default; Gemma 3's config.json sets false
        raise unsupported("a SigLIP attention-pooling head (vision_use_head), which Gemma 3 never reads")
    image, patch = int(v.get("image_size", 224)), int(v.get("patch_size", 16))
    tokens = int(hf.get("mm_tokens_per_image", 256))
    side, patches = math.isqrt(tokens), image // patch
    if side * side != tokens or patches % side:
        raise unsupported(
            f"mm_tokens_per_image {tokens} from {patches} x {patches} patches (a square number that divides the grid)"
        )
    return VisionConfig(
        image_size=image,
        patch_size=patch,
        dim=int(v.get("hidden_size", 768)),
        n_layers=int(v.get("num_hidden_layers", 12)),
        n_heads=int(v.get("num_attention_heads", 12)),
        hidden_dim=int(v.get("intermediate_size", 3072)),
        norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        activation=VISION_ACTIVATIONS[act],
        text_dim=int(hf["text_config"]["hidden_size"]),
        connector="rms_norm_linear",
        pool_kernel=patches // side,
        bidirectional_image_attention=True,
    )


def preprocessing(vision: VisionConfig) -> ImageProcessing:
    """Gemma3Processor's defaults: resize to S x S (BILINEAR), mean = std = 0.5; pan-and-scan off
    unless the processor files turn it on, then with its defaults (crops of at least 256 px, at most
    4, for an aspect ratio of at least 1.2)."""
    return ImageProcessing(
        kind="gemma3",
        tile_size=vision.image_size,
        longest_edge=0,
        tokens_per_image=vision.tokens_per_image,
        do_image_splitting=False,
        max_tiles=4,
        min_crop_size=256,
        min_crop_ratio=1.2,
        resample=BILINEAR,
        placeholder="<start_of_image>",
        image_token="<image_soft_token>",
        image_start="<start_of_image>",
        image_end="<end_of_image>",
    )


def _spec(name: str, description: str, text: DecoderConfig, vision: VisionConfig, image_token_id: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        family="gemma3-vision",
        description=description,
        config=text,
        key_map=TEXT_KEY_MAP + VISION_KEY_MAP,
        config_from_checkpoint=text_config_from_hf,
        hf_model_types=("gemma3",),
        bos_id=2,  # <bos>
        eos_ids=(1, 106),  # <eos>, <end_of_turn>
        chat_template=chat_templates.GEMMA_VISION,
        vision=VisionSpec(
            config=vision,
            config_from_checkpoint=vision_config_from_hf,
            preprocessing=preprocessing(vision),
            image_token_id=image_token_id,
            transposed_keys=TRANSPOSED,
        ),
    )


SPECS = (
    _spec(
        "gemma3-4b",
        "google/gemma-3-4b-it",
        DecoderConfig(
            vocab_size=262208,
            dim=2560,
            n_layers=34,
            n_heads=8,
            n_kv_heads=4,
            hidden_dim=10240,
            head_dim=256,
            norm_eps=1e-6,
            norm_unit_offset=True,
            sandwich_norms=True,
            rope_theta=1000000.0,
            rope_scaling=LinearRopeScaling(factor=8.0),
            rope_local_theta=10000.0,
            sliding_window=1024,
            sliding_window_layers=tuple(i for i in range(34) if (i + 1) % 6),
            qk_norm=True,
            attention_scale=256**-0.5,
            activation="gelu_tanh",
            scale_embeddings=True,
            tie_embeddings=True,
            max_position_embeddings=131072,
        ),
        # SigLIP so400m, patch 14, 896 px: 64 x 64 patches pooled by 4 -> 256 tokens per image
        VisionConfig(
            image_size=896,
            patch_size=14,
            dim=1152,
            n_layers=27,
            n_heads=16,
            hidden_dim=4304,
            text_dim=2560,
            connector="rms_norm_linear",
            pool_kernel=4,
            bidirectional_image_attention=True,
        ),
        image_token_id=262144,  # <image_soft_token>
    ),
)
