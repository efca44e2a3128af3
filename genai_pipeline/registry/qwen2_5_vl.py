"""Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`): a ViT with 2D RoPE, RMSNorm, SwiGLU MLPs and
window attention (full attention in `fullatt_block_indexes`), whose 2 x 2 patch blocks a merger
MLP projects into a Qwen2 text decoder with M-RoPE (`mrope_section`).

Sizes are those of Qwen/Qwen2.5-VL-3B-Instruct's config.json (checked against a public copy of it,
not the Hub itself: no network here; 3.75 B parameters); a checkpoint's own files win. Its tower takes any
multiple of 28 px; a program takes sides up to S (image_processing.py): 448 px here, at most
32 x 32 patches, 256 image tokens, unless the processor's `max_pixels` asks for less.
"""

from __future__ import annotations

from genai_pipeline.image_processing import ImageProcessing
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.models.vision_config import VisionConfig
from genai_pipeline.registry.hf_config import flat_rope_parameters, unsupported
from genai_pipeline.registry.llama import HF_KEY_MAP
from genai_pipeline.registry.multimodal import VisionSpec
from genai_pipeline.registry.qwen import qwen2_config_from_hf
from genai_pipeline.registry.spec import ModelSpec

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3
IMAGE_SIZE = 448  # the program's largest side unless the processor's max_pixels asks for less
MIN_PIXELS, MAX_PIXELS = 3136, 12845056

# Both layouts: the Hub's (transformers 4.x: `model.layers.*`, `visual.*`) and 5.x's
# (`model.language_model.layers.*`, `model.visual.*`).
TEXT_KEY_MAP = tuple(
    (
        pattern.replace(r"model\.", r"model\.(?:language_model\.)?", 1) if pattern.startswith(r"model\.") else pattern,
        f"decoder.{ours}",
    )
    for pattern, ours in HF_KEY_MAP
)
_TOWER = r"(?:model\.)?visual\."
_BLOCK = _TOWER + r"blocks\.(\d+)\."
VISION_KEY_MAP: tuple[tuple[str, str], ...] = (
    (_TOWER + r"patch_embed\.proj\.weight", "vision.embeddings.patch_embedding.weight"),
    (_BLOCK + r"norm([12])\.weight", r"vision.layers.\1.layer_norm\2.weight"),
    (_BLOCK + r"attn\.proj\.(weight|bias)", r"vision.layers.\1.self_attn.out_proj.\2"),
    (_BLOCK + r"mlp\.((?:gate|up|down)_proj\.(?:weight|bias))", r"vision.layers.\1.mlp.\2"),
    (_TOWER + r"merger\.ln_q\.weight", "vision.projection.ln_q.weight"),
    (_TOWER + r"merger\.mlp\.0\.(weight|bias)", r"vision.projection.linear_1.\1"),
    (_TOWER + r"merger\.mlp\.2\.(weight|bias)", r"vision.projection.linear_2.\1"),
)
# attn.qkv = [q; k; v] along the output dim
FUSED_KEY_MAP: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        _BLOCK + r"attn\.qkv\.(weight|bias)",
        tuple(rf"vision.layers.\1.self_attn.{p}_proj.\2" for p in "qkv"),
    ),
)


def _text(hf: dict) -> dict:
    """The text decoder's keys: 5.x nests them in `text_config`, the Hub's 4.x files keep them flat."""
    text = hf.get("text_config") or hf
    return {**text, "tie_word_embeddings": hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}


def text_config_from_hf(hf: dict) -> DecoderConfig:
    text = _text(hf)
    params = dict(flat_rope_parameters(text))
    section = params.pop("mrope_section", None)
    if params.get("rope_type", params.get("type")) not in ("default", "mrope") or section is None:
        raise unsupported(f"Qwen2.5-VL RoPE other than M-RoPE with an mrope_section ({params})")
    params["rope_type"] = "default"
    params.pop("type", None)
    config = qwen2_config_from_hf({**text, "rope_parameters": params})
    return DecoderConfig.from_dict({**config.__dict__, "mrope_section": tuple(int(n) for n in section)})


def vision_config_from_hf(hf: dict) -> VisionConfig:
    """transformers' Qwen2_5_VLVisionConfig defaults stand in for keys a config.json leaves out;
    the input size is the processor's (VisionSpec.size_from_processor)."""
    v = hf.get("vision_config") or {}
    if v.get("hidden_act", "silu") != "silu" or int(v.get("in_channels", v.get("in_chans", 3))) != 3:
        raise unsupported("a Qwen2.5-VL vision tower other than SiLU on RGB")
    heads = int(v.get("num_heads", v.get("num_attention_heads", 16)))
    return VisionConfig(
        image_size=IMAGE_SIZE,
        patch_size=int(v.get("patch_size", 14)),
        dim=int(v.get("hidden_size", 3584)),
        n_layers=int(v.get("depth", v.get("num_hidden_layers", 32))),
        n_heads=heads,
        hidden_dim=int(v.get("intermediate_size", 3420)),
        text_dim=int(v.get("out_hidden_size", 3584)),
        norm_eps=1e-6,
        activation="silu",
        scale_factor=int(v.get("spatial_merge_size", 2)),
        connector="merger",
        patch_bias=False,
        post_norm=False,
        norm="rms",
        mlp="gated",
        learned_positions=False,
        rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        window_size=int(v.get("window_size", 112)),
        full_attention_layers=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))),
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
    )


def _spec(name: str, description: str, text: DecoderConfig, vision: VisionConfig) -> ModelSpec:
    return ModelSpec(
        name=name,
        family="qwen2_5_vl",
        description=description,
        config=text,
        key_map=TEXT_KEY_MAP + VISION_KEY_MAP,
        fused_key_map=FUSED_KEY_MAP,
        config_from_checkpoint=text_config_from_hf,
        hf_model_types=("qwen2_5_vl",),
        bos_id=None,  # Qwen's tokenizer adds none
        eos_ids=(151645,),  # <|im_end|>
        vision=VisionSpec(
            config=vision,
            config_from_checkpoint=vision_config_from_hf,
            preprocessing=ImageProcessing(
                kind="qwen2_vl",
                tile_size=vision.image_size,
                longest_edge=MAX_PIXELS,
                shortest_edge=MIN_PIXELS,
                tokens_per_image=vision.tokens_per_image,
                resample=BICUBIC,
                image_mean=CLIP_MEAN,
                image_std=CLIP_STD,
                image_token="<|image_pad|>",
                image_start="<|vision_start|>",
                image_end="<|vision_end|>",
            ),
            image_token_id=151655,  # <|image_pad|>
            size_from_processor=True,
        ),
    )


SPECS = (
    _spec(
        "qwen2_5-vl-3b",
        "Qwen/Qwen2.5-VL-3B-Instruct",
        DecoderConfig(
            vocab_size=151936,
            dim=2048,
            n_layers=36,
            n_heads=16,
            n_kv_heads=2,
            hidden_dim=11008,
            qkv_bias=True,
            norm_eps=1e-6,
            rope_theta=1000000.0,
            mrope_section=(16, 24, 24),
            tie_embeddings=True,
            max_position_embeddings=128000,
        ),
        VisionConfig(
            image_size=IMAGE_SIZE,
            patch_size=14,
            dim=1280,
            n_layers=32,
            n_heads=16,
            hidden_dim=3420,
            text_dim=2048,
            norm_eps=1e-6,
            activation="silu",
            scale_factor=2,
            connector="merger",
            patch_bias=False,
            post_norm=False,
            norm="rms",
            mlp="gated",
            learned_positions=False,
            rope_theta=10000.0,
            temporal_patch_size=2,
            window_size=112,
            full_attention_layers=(7, 15, 23, 31),
            image_mean=CLIP_MEAN,
            image_std=CLIP_STD,
        ),
    ),
)
