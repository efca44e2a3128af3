"""The one export-friendly vision encoder: every supported image tower is this file plus a VisionConfig.

Read top to bottom: input normalisation, patch embedding, encoder layer, connector, encoder (the
config: vision_config.py; Qwen2.5-VL's block kinds: qwen_vit.py).

A `VisionEncoder` takes raw RGB, uint8 `[1, 3, S, S]`, and returns the image's embeddings in the
text decoder's space, `[1, N, text_dim]`: rescaling and mean/std normalisation happen inside the
graph, so a device feeds decoded pixels as they are. Resizing and tiling stay in the runtime
(`image_processing.py`): the program's input size is fixed (Qwen2.5-VL's: bounded).

Families (switches on the config, not on names):
- SigLIP as Idefics3 / SmolVLM use it: conv patch embedding, learned positions, pre-norm layers
  with GeLU (tanh) MLPs, a final LayerNorm; the connector pixel-shuffles `scale_factor`² neighbouring
  patches into one token and projects it with a bias-free linear (`connector="linear"`).
- CLIP as LLaVA-1.5 uses it: a bias-free patch conv, a class token in front (`class_token`), a
  LayerNorm before the layers (`pre_norm`), quick-GeLU MLPs; LLaVA reads the second-to-last
  layer's output (so `n_layers` counts only the layers run, and `post_norm` is off) without the
  class token (`drop_class_token`), through a two-layer GeLU MLP (`connector="mlp"`).
- InternViT as InternVL uses it: CLIP's layout with a biased patch conv, per-channel layer scale on
  both residual branches (`layer_scale`), no final norm; its connector pixel-shuffles like Idefics3,
  then LayerNorm, linear, GeLU, linear (`connector="mlp"`, `projector_norm`).
- Qwen2.5-VL's ViT: a bias-free patch conv over `temporal_patch_size` frames (a still image is
  that frame repeated, so the conv is one over the frame with the frames' kernels summed), no
  learned positions but 2D RoPE in every layer (`rope_theta`), RMSNorm (`norm="rms"`), SwiGLU
  MLPs with biases (`mlp="gated"`), attention within `window_size`-pixel windows except in
  `full_attention_layers`, no final norm; the connector (`connector="merger"`) takes each 2 x 2
  block of patches (the tokens run block by block, as Qwen2VLImageProcessor orders them):
  RMSNorm, then linear, GeLU, linear over the block's concatenated features. Its input takes any
  multiple of 28 px per side (the grid follows the image; its block kinds: qwen_vit.py).
- SigLIP as Gemma 3 uses it: Idefics3's tower at 896 px; its connector average-pools `pool_kernel`²
  neighbouring patches into one token (64 x 64 patches -> 16 x 16 tokens), then Gemma's RMSNorm
  (scale 1 + weight) and a bias-free linear (`connector="rms_norm_linear"`). Its text decoder lets the
  tokens of one image see each other both ways (`bidirectional_image_attention`): the program's
  embeddings then carry one more column saying which rows are an image's (image_rows.py).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from genai_pipeline.models.decoder import RMSNorm, apply_rope, gelu_tanh
from genai_pipeline.models.image_rows import MRopeCursor, image_columns, split_columns, text_columns
from genai_pipeline.models.qwen_vit import (
    GatedMLP,
    PatchMerger,
    TemporalPatchConv,
    block_order,
    rope_2d_tables,
    window_mask,
)
from genai_pipeline.models.vision_config import VisionConfig


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"gelu_tanh": gelu_tanh, "gelu": F.gelu, "quick_gelu": quick_gelu, "silu": F.silu}


def norm_layer(config: VisionConfig, dim: int) -> nn.Module:
    return nn.LayerNorm(dim, eps=config.norm_eps) if config.norm == "layer" else RMSNorm(dim, config.norm_eps)


class Normalize(nn.Module):
    """uint8 RGB -> ((x * rescale) - mean) / std, as the Hugging Face processors do in float."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.rescale = config.rescale_factor
        self.register_buffer("mean", torch.tensor(config.image_mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(config.image_std).view(1, 3, 1, 1), persistent=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return (pixels.to(torch.float32) * self.rescale - self.mean) / self.std


def position_ids(n: int) -> torch.Tensor:
    """[1, n*n]: Idefics3's bucketed position of each patch of a full n x n grid."""
    boundaries = torch.arange(1 / n, 1.0, 1 / n)
    coords = torch.clamp(torch.arange(n, dtype=torch.float32) * (1.0 / n), max=1.0 - 1e-6)
    buckets = torch.bucketize(coords, boundaries, right=True)
    return (buckets[:, None] * n + buckets[None, :]).reshape(1, -1)


def embedding_position_ids(config: VisionConfig) -> torch.Tensor:
    """[1, positions]: in order for CLIP (class token first); Idefics3's buckets otherwise."""
    if config.class_token:
        return torch.arange(config.positions).unsqueeze(0)
    return position_ids(config.patches_per_side)


class PatchEmbedding(nn.Module):
    """Conv patches (after a class token, for CLIP) plus learned positions. Idefics3 buckets
    fractional patch coordinates into the position table to allow other sizes; for the full square
    input that is the identity, computed here once with the same ops so float rounding cannot make
    them differ. Qwen2.5-VL: no positions here (RoPE in the layers), patches in merge-block order."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        p = config.patch_size
        if config.temporal_patch_size > 1:
            self.patch_embedding = TemporalPatchConv(config.dim, p, config.temporal_patch_size)
        else:
            self.patch_embedding = nn.Conv2d(3, config.dim, kernel_size=p, stride=p, bias=config.patch_bias)
        self.class_embedding = nn.Parameter(torch.zeros(config.dim)) if config.class_token else None
        self.position_embedding = nn.Embedding(config.positions, config.dim) if config.learned_positions else None
        self.register_buffer("position_ids", embedding_position_ids(config), persistent=False)
        self.merge_blocks = config.scale_factor if config.connector == "merger" else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = self.patch_embedding(x)  # [1, dim, rows, cols]
        h = grid.flatten(2).transpose(1, 2)  # [1, rows*cols, dim]
        if self.merge_blocks:
            h = h[:, block_order(grid.shape[2], grid.shape[3], self.merge_blocks)]
        if self.class_embedding is not None:
            h = torch.cat([self.class_embedding.view(1, 1, -1), h], dim=1)
        return h if self.position_embedding is None else h + self.position_embedding(self.position_ids)


class Attention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.dim // config.n_heads
        self.q_proj = nn.Linear(config.dim, config.dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.dim, config.dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.dim, config.dim, bias=config.qkv_bias)
        self.out_proj = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor, rope: tuple | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            t = t.view(b, s, self.n_heads, self.head_dim)
            return (t if rope is None else apply_rope(t, *rope)).transpose(1, 2)

        q, k = heads(self.q_proj(x)), heads(self.k_proj(x))
        v = self.v_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(y.transpose(1, 2).reshape(b, s, -1))


class EncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layer_norm1 = norm_layer(config, config.dim)
        self.self_attn = Attention(config)
        self.layer_norm2 = norm_layer(config, config.dim)
        gated = config.mlp == "gated"
        self.mlp = GatedMLP(config.dim, config.hidden_dim, ACTIVATIONS[config.activation]) if gated else None
        self.fc1 = None if gated else nn.Linear(config.dim, config.hidden_dim)
        self.fc2 = None if gated else nn.Linear(config.hidden_dim, config.dim)
        self.act = ACTIVATIONS[config.activation]
        self.lambda_1 = nn.Parameter(torch.ones(config.dim)) if config.layer_scale else None
        self.lambda_2 = nn.Parameter(torch.ones(config.dim)) if config.layer_scale else None

    def forward(self, x: torch.Tensor, rope: tuple | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        attention = self.self_attn(self.layer_norm1(x), rope, mask)
        x = x + (attention if self.lambda_1 is None else self.lambda_1 * attention)
        h = self.layer_norm2(x)
        mlp = self.fc2(self.act(self.fc1(h))) if self.mlp is None else self.mlp(h)
        return x + (mlp if self.lambda_2 is None else self.lambda_2 * mlp)


class MLPProjector(nn.Module):
    """LLaVA's connector: linear, GeLU, linear (both with bias); InternVL's has a LayerNorm first."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        width = config.dim * config.scale_factor**2
        self.layer_norm = nn.LayerNorm(width) if config.projector_norm else nn.Identity()
        self.linear_1 = nn.Linear(width, config.text_dim)
        self.linear_2 = nn.Linear(config.text_dim, config.text_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(self.layer_norm(x))))


class RMSNormLinearProjector(nn.Module):
    """Gemma 3's connector: RMSNorm with scale (1 + weight) (`mm_soft_emb_norm`), then a bias-free
    linear (`mm_input_projection_weight`, which checkpoints store transposed)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm = RMSNorm(config.dim, config.norm_eps, unit_offset=True)
        self.linear = nn.Linear(config.dim, config.text_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x))


def average_pool(x: torch.Tensor, kernel: int) -> torch.Tensor:
    """[1, n*n, d] -> [1, (n / kernel)², d]: each kernel x kernel square of the patch grid averaged
    into one token, row-major, as Gemma 3's projector pools."""
    b, seq, d = x.shape
    n = int(seq**0.5)
    grid = x.transpose(1, 2).reshape(b, d, n, n)
    return F.avg_pool2d(grid, kernel).flatten(2).transpose(1, 2)


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[1, n*n, d] -> [1, n*n / scale², d * scale²], as Idefics3's connector orders the features."""
    b, seq, d = x.shape
    n = int(seq**0.5)
    x = x.reshape(b, n, n // scale, d * scale).permute(0, 2, 1, 3)
    x = x.reshape(b, n // scale, n // scale, d * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(b, seq // (scale * scale), d * scale * scale)


class VisionEncoder(nn.Module):
    """uint8 [1, 3, S, S] -> image embeddings [1, tokens_per_image, text_dim]. Qwen2.5-VL's:
    uint8 [1, 3, H, W], any multiple of patch x merge px, -> [1, H x W / (patch x merge)², text_dim]."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.normalize = Normalize(config)
        self.embeddings = PatchEmbedding(config)
        self.pre_layrnorm = norm_layer(config, config.dim) if config.pre_norm else nn.Identity()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_layers))
        self.post_layernorm = norm_layer(config, config.dim) if config.post_norm else nn.Identity()
        if config.connector == "linear":
            self.projection = nn.Linear(config.dim * config.scale_factor**2, config.text_dim, bias=False)
        elif config.connector == "rms_norm_linear":
            self.projection = RMSNormLinearProjector(config)
        elif config.connector == "mlp":
            self.projection = MLPProjector(config)
        else:
            self.projection = PatchMerger(config.dim, config.scale_factor, config.text_dim, config.norm_eps)
        # which layers attend within windows (Qwen2.5-VL); the others see every token
        self.layer_windowed = tuple(
            bool(config.window_size) and i not in config.full_attention_layers for i in range(config.n_layers)
        )

    def grid(self, pixels: torch.Tensor) -> tuple[int, int]:
        """The patches per column and per row of an image of this size."""
        p = self.config.patch_size
        return pixels.shape[-2] // p, pixels.shape[-1] // p

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """The hidden state the connector reads, for normalised float pixels: [1, positions, dim]."""
        h = self.pre_layrnorm(self.embeddings(pixels))
        config, (rows, cols) = self.config, self.grid(pixels)
        rope = mask = None
        if config.rope_theta is not None:
            rope = rope_2d_tables(rows, cols, config.scale_factor, config.dim // config.n_heads, config.rope_theta)
        if any(self.layer_windowed):
            side = config.window_size // (config.patch_size * config.scale_factor)  # merged tokens per window side
            mask = window_mask(rows, cols, config.scale_factor, side)
        for layer, windowed in zip(self.layers, self.layer_windowed):
            h = layer(h, rope, mask if windowed else None)
        return self.post_layernorm(h)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.features(self.normalize(pixels))
        if self.config.class_token and self.config.drop_class_token:
            h = h[:, 1:]
        if self.config.scale_factor > 1 and self.config.connector != "merger":
            h = pixel_shuffle(h, self.config.scale_factor)
        if self.config.pool_kernel > 1:
            h = average_pool(h, self.config.pool_kernel)
        return self.projection(h)

    def reset_buffers(self) -> None:
        """(Re)create the constant buffers, e.g. after building on the meta device."""
        self.normalize = Normalize(self.config)
        self.embeddings.position_ids = embedding_position_ids(self.config)


def unused_tower_tensor(name: str, config: VisionConfig) -> bool:
    """A checkpoint tensor of the tower (our name) the encoder never reads: a layer after the one
    the connector reads, or the final norm when it reads an earlier layer (LLaVA)."""
    layer = re.match(r"vision\.layers\.(\d+)\.", name)
    return (layer is not None and int(layer[1]) >= config.n_layers) or (
        not config.post_norm and name.startswith("vision.post_layernorm.")
    )


class VisionLanguageModel(nn.Module):
    """The text decoder and the image tower side by side: the one module every method of a
    multimodal program wraps, so the methods name (and share) the same tensors. Its embeddings
    carry the columns (image_rows.py) its decoder reads: `rows_kind`; with M-RoPE (Qwen2.5-VL)
    the positions' cursor too."""

    def __init__(self, decoder: nn.Module, vision: VisionEncoder):
        super().__init__()
        self.decoder, self.vision = decoder, vision
        self.mrope = MRopeCursor(decoder.max_seq_len) if decoder.config.mrope_section else None
        self.rows_kind = (
            "mrope" if self.mrope is not None else "flag" if vision.config.bidirectional_image_attention else "none"
        )

    def text_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids [1, T] -> their embeddings with the columns, [1, T, D + c]."""
        return text_columns(self.decoder.embed(tokens), self.rows_kind)

    def image_rows(self, pixels: torch.Tensor) -> torch.Tensor:
        """An image, uint8 [1, 3, H, W] -> its embeddings with the columns, [1, N, D + c]."""
        scale = self.vision.config.scale_factor * self.vision.config.pool_kernel
        return image_columns(self.vision(pixels), self.rows_kind, self.vision.grid(pixels)[1] // scale)

    def decode(self, rows: torch.Tensor, input_pos: torch.Tensor, last_only: bool = True) -> torch.Tensor:
        """The decoder on embeddings with their columns, [1, T, D + c], at cache position input_pos."""
        embeddings, columns = split_columns(rows, self.rows_kind)
        positions = self.mrope(input_pos, columns) if self.mrope is not None else None
        masks = columns[..., 0] if self.rows_kind == "flag" else None
        return self.decoder.forward_embeddings(
            embeddings, input_pos, last_only, image_tokens=masks, rope_positions=positions
        )
