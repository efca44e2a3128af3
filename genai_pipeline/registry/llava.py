"""LLaVA-1.5 (`LlavaForConditionalGeneration`): CLIP ViT-L/14 at 336 px read at its second-to-last
layer without the class token, a two-layer GeLU MLP, and a Llama 2 text decoder.

Sizes are those of the public llava-hf config.json and processor files; a checkpoint's own files win.
"""

from __future__ import annotations

from genai_pipeline.image_processing import ImageProcessing
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.models.vision_config import VisionConfig
from genai_pipeline.registry.hf_config import text_config, unsupported
from genai_pipeline.registry.llama import HF_KEY_MAP, config_from_hf
from genai_pipeline.registry.multimodal import VisionSpec, composite_text_key_map
from genai_pipeline.registry.spec import ModelSpec

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC

TEXT_KEY_MAP = composite_text_key_map(HF_KEY_MAP)
_TOWER = r"(?:model\.)?vision_tower\.(?:vision_model\.)?"
VISION_KEY_MAP: tuple[tuple[str, str], ...] = (
    (
        _TOWER + r"embeddings\.(class_embedding|patch_embedding\.weight|position_embedding\.weight)",
        r"vision.embeddings.\1",
    ),
    (_TOWER + r"pre_layrnorm\.(weight|bias)", r"vision.pre_layrnorm.\1"),
    (
        _TOWER + r"encoder\.layers\.(\d+)\.self_attn\.((?:q|k|v|out)_proj\.(?:weight|bias))",
        r"vision.layers.\1.self_attn.\2",
    ),
    (_TOWER + r"encoder\.layers\.(\d+)\.(layer_norm[12]\.(?:weight|bias))", r"vision.layers.\1.\2"),
    (_TOWER + r"encoder\.layers\.(\d+)\.mlp\.(fc[12]\.(?:weight|bias))", r"vision.layers.\1.\2"),
    (_TOWER + r"post_layernorm\.(weight|bias)", r"vision.post_layernorm.\1"),  # unread: see unused_tower_tensor
    (r"(?:model\.)?multi_modal_projector\.(linear_[12]\.(?:weight|bias))", r"vision.projection.\1"),
)


def text_config_from_hf(hf: dict) -> DecoderConfig:
    return config_from_hf(text_config(hf))


def vision_config_from_hf(hf: dict) -> VisionConfig:
    """transformers' CLIPVisionConfig defaults stand in for keys a config.json leaves out."""
    v = hf.get("vision_config") or {}
    layer = hf.get("vision_feature_layer", -2)
    strategy = hf.get("vision_feature_select_strategy", "default")
    if not isinstance(layer, int):
        raise unsupported(f"vision_feature_layer {layer} (features of several layers)")
    if strategy not in ("default", "full") or v.get("hidden_act", "quick_gelu") != "quick_gelu":
        raise unsupported(f"vision_feature_select_strategy '{strategy}' / activation '{v.get('hidden_act')}'")
    if hf.get("projector_hidden_act", "gelu") != "gelu" or not hf.get("multimodal_projector_bias", True):
        raise unsupported("a projector other than linear-GeLU-linear with biases")
    n_layers = int(v.get("num_hidden_layers", 12))
    run = n_layers + 1 + layer if layer < 0 else layer  # hidden_states[0] is the embeddings
    return VisionConfig(
        image_size=int(v.get("image_size", 224)),
        patch_size=int(v.get("patch_size", 32)),
        dim=int(v.get("hidden_size", 768)),
        n_layers=run,
        n_heads=int(v.get("num_attention_heads", 12)),
        hidden_dim=int(v.get("intermediate_size", 3072)),
        norm_eps=float(v.get("layer_norm_eps", 1e-5)),
        activation="quick_gelu",
        text_dim=int(hf["text_config"]["hidden_size"]),
        connector="mlp",
        patch_bias=False,
        class_token=True,
        drop_class_token=strategy == "default",
        pre_norm=True,
        post_norm=False,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )


def _spec(name: str, description: str, text: DecoderConfig, vision: VisionConfig, image_token_id: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        family="llava",
        description=description,
        config=text,
        key_map=TEXT_KEY_MAP + VISION_KEY_MAP,
        config_from_checkpoint=text_config_from_hf,
        hf_model_types=("llava",),
        bos_id=1,
        eos_ids=(2,),
        vision=VisionSpec(
            config=vision,
            config_from_checkpoint=vision_config_from_hf,
            preprocessing=ImageProcessing(
                kind="clip",
                tile_size=vision.image_size,
                longest_edge=0,
                shortest_edge=vision.image_size,
                tokens_per_image=vision.tokens_per_image,
                resample=BICUBIC,
                image_mean=CLIP_MEAN,
                image_std=CLIP_STD,
            ),
            image_token_id=image_token_id,
        ),
    )


SPECS = (
    _spec(
        "llava-1_5-7b",
        "llava-hf/llava-1.5-7b-hf",
        DecoderConfig(
            vocab_size=32064,
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=32,
            hidden_dim=11008,
            max_position_embeddings=4096,
        ),
        # CLIP ViT-L/14 at 336 px: 24 layers, read after 23; 576 patch tokens
        VisionConfig(
            image_size=336,
            patch_size=14,
            dim=1024,
            n_layers=23,
            n_heads=16,
            hidden_dim=4096,
            text_dim=4096,
            activation="quick_gelu",
            connector="mlp",
            patch_bias=False,
            class_token=True,
            drop_class_token=True,
            pre_norm=True,
            post_norm=False,
            norm_eps=1e-5,
            image_mean=CLIP_MEAN,
            image_std=CLIP_STD,
        ),
        image_token_id=32000,
    ),
)
