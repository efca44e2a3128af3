"""InternVL 3 (`InternVLForConditionalGeneration`): InternViT (CLIP-like, layer scale) whose patch
features are pixel-shuffled by 2 into a LayerNorm + two-layer GeLU MLP, and a Qwen2 text decoder.

Sizes are those of the public OpenGVLab `-hf` config.json and processor files; a checkpoint's own files win.
"""

from __future__ import annotations

from genai_pipeline.image_processing import ImageProcessing
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.models.vision_config import VisionConfig
from genai_pipeline.registry.hf_config import unsupported
from genai_pipeline.registry.llava import TEXT_KEY_MAP
from genai_pipeline.registry.multimodal import VisionSpec
from genai_pipeline.registry.qwen import qwen2_config_from_hf
from genai_pipeline.registry.spec import ModelSpec

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
BICUBIC = 3

_TOWER = r"(?:model\.)?vision_tower\."
_LAYER = _TOWER + r"encoder\.layer\.(\d+)\."
VISION_KEY_MAP: tuple[tuple[str, str], ...] = (
    (_TOWER + r"embeddings\.cls_token", "vision.embeddings.class_embedding"),
    (_TOWER + r"embeddings\.position_embeddings", "vision.embeddings.position_embedding.weight"),
    (_TOWER + r"embeddings\.patch_embeddings\.projection\.(weight|bias)", r"vision.embeddings.patch_embedding.\1"),
    (_LAYER + r"attention\.((?:q|k|v)_proj\.(?:weight|bias))", r"vision.layers.\1.self_attn.\2"),
    (_LAYER + r"attention\.projection_layer\.(weight|bias)", r"vision.layers.\1.self_attn.out_proj.\2"),
    (_LAYER + r"layernorm_before\.(weight|bias)", r"vision.layers.\1.layer_norm1.\2"),
    (_LAYER + r"layernorm_after\.(weight|bias)", r"vision.layers.\1.layer_norm2.\2"),
    (_LAYER + r"mlp\.(fc[12]\.(?:weight|bias))", r"vision.layers.\1.\2"),
    (_LAYER + r"(lambda_[12])", r"vision.layers.\1.\2"),
    (_TOWER + r"layernorm\.(weight|bias)", r"vision.post_layernorm.\1"),
    (
        r"(?:model\.)?multi_modal_projector\.((?:layer_norm|linear_1|linear_2)\.(?:weight|bias))",
        r"vision.projection.\1",
    ),
)


def text_config_from_hf(hf: dict) -> DecoderConfig:
    text = hf["text_config"]
    return qwen2_config_from_hf(
        {**text, "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}
    )


def _square(value, name: str) -> int:
    sizes = value if isinstance(value, (list, tuple)) else (value, value)
    if sizes[0] != sizes[1]:
        raise unsupported(f"a non-square vision {name} {sizes}")
    return int(sizes[0])


def vision_config_from_hf(hf: dict) -> VisionConfig:
    """transformers' InternVLVisionConfig defaults stand in for keys a config.json leaves out."""
    v = hf.get("vision_config") or {}
    if (
        v.get("use_qk_norm")
        or v.get("norm_type", "layer_norm") != "layer_norm"
        or not v.get("use_absolute_position_embeddings", True)
    ):
        raise unsupported("an InternViT with qk-norm, RMSNorm or without absolute positions (InternViT-6B)")
    if hf.get("vision_feature_layer", -1) != -1 or hf.get("vision_feature_select_strategy", "default") != "default":
        raise unsupported("InternVL features other than the last layer's without the class token")
    if v.get("hidden_act", "gelu") != "gelu" or hf.get("projector_hidden_act", "gelu") != "gelu":
        raise unsupported("InternVL activations other than GeLU")
    return VisionConfig(
        image_size=_square(v.get("image_size", 448), "image_size"),
        patch_size=_square(v.get("patch_size", 14), "patch_size"),
        dim=int(v.get("hidden_size", 1024)),
        n_layers=int(v.get("num_hidden_layers", 24)),
        n_heads=int(v.get("num_attention_heads", 16)),
        hidden_dim=int(v.get("intermediate_size", 4096)),
        norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        activation="gelu",
        text_dim=int(hf["text_config"]["hidden_size"]),
        scale_factor=round(1 / float(hf.get("downsample_ratio", 0.5))),
        connector="mlp",
        projector_norm=True,
        class_token=True,
        drop_class_token=True,
        post_norm=not v.get("use_mean_pooling", True),
        qkv_bias=bool(v.get("attention_bias", False)),
        layer_scale=True,
        image_mean=IMAGENET_MEAN,
        image_std=IMAGENET_STD,
    )


def _spec(name: str, description: str, text: DecoderConfig) -> ModelSpec:
    # InternViT-300M-448px-V2_5: 32 x 32 patches, shuffled by 2: 256 tokens per tile
    vision = VisionConfig(
        image_size=448,
        patch_size=14,
        dim=1024,
        n_layers=24,
        n_heads=16,
        hidden_dim=4096,
        text_dim=text.dim,
        activation="gelu",
        scale_factor=2,
        connector="mlp",
        projector_norm=True,
        class_token=True,
        drop_class_token=True,
        post_norm=False,
        qkv_bias=True,
        layer_scale=True,
        image_mean=IMAGENET_MEAN,
        image_std=IMAGENET_STD,
    )
    return ModelSpec(
        name=name,
        family="internvl",
        description=description,
        config=text,
        key_map=TEXT_KEY_MAP + VISION_KEY_MAP,
        config_from_checkpoint=text_config_from_hf,
        hf_model_types=("internvl",),
        bos_id=None,  # Qwen's tokenizer adds none
        eos_ids=(151645,),  # <|im_end|>
        vision=VisionSpec(
            config=vision,
            config_from_checkpoint=vision_config_from_hf,
            preprocessing=ImageProcessing(
                kind="internvl",
                tile_size=448,
                longest_edge=0,
                tokens_per_image=vision.tokens_per_image,
                max_tiles=12,
                resample=BICUBIC,
                image_mean=IMAGENET_MEAN,
                image_std=IMAGENET_STD,
                image_token="<IMG_CONTEXT>",
                image_start="<img>",
                image_end="</img>",
            ),
            image_token_id=151667,  # <IMG_CONTEXT>
        ),
    )


SPECS = (
    _spec(
        "internvl3-1b",
        "OpenGVLab/InternVL3-1B-hf",
        DecoderConfig(
            vocab_size=151674,
            dim=896,
            n_layers=24,
            n_heads=14,
            n_kv_heads=2,
            hidden_dim=4864,
            qkv_bias=True,
            norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
        ),
    ),
    _spec(
        "internvl3-2b",
        "OpenGVLab/InternVL3-2B-hf",
        DecoderConfig(
            vocab_size=151674,
            dim=1536,
            n_layers=28,
            n_heads=12,
            n_kv_heads=2,
            hidden_dim=8960,
            qkv_bias=True,
            norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
        ),
    ),
)
