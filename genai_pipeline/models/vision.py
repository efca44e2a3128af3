"""The one export-friendly vision encoder: every supported image tower is this file plus a VisionConfig.

Read top to bottom: config, input normalisation, patch embedding, encoder layer, connector, encoder.

A `VisionEncoder` takes raw RGB, uint8 `[1, 3, S, S]`, and returns the image's embeddings in the
text decoder's space, `[1, N, text_dim]`: rescaling and mean/std normalisation happen inside the
graph, so a device feeds decoded pixels as they are. Resizing and tiling stay in the runtime
(`image_processing.py`): the program's input size is fixed.

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
- SigLIP as Gemma 3 uses it: Idefics3's tower at 896 px; its connector average-pools `pool_kernel`²
  neighbouring patches into one token (64 x 64 patches -> 16 x 16 tokens), then Gemma's RMSNorm
  (scale 1 + weight) and a bias-free linear (`connector="rms_norm_linear"`). Its text decoder lets the
  tokens of one image see each other both ways (`bidirectional_image_attention`): the program's
  embeddings then carry one more column saying which rows are an image's (`with_image_flag`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from genai_pipeline.models.decoder import RMSNorm, gelu_tanh


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"gelu_tanh": gelu_tanh, "gelu": F.gelu, "quick_gelu": quick_gelu}
CONNECTORS = ("linear", "mlp", "rms_norm_linear")


@dataclass(frozen=True)
class VisionConfig:
    image_size: int  # S: the encoder's square input, pixels
    patch_size: int
    dim: int
    n_layers: int
    n_heads: int
    hidden_dim: int
    text_dim: int  # width of the text decoder's embeddings
    norm_eps: float = 1e-6
    activation: str = "gelu_tanh"
    scale_factor: int = 1  # pixel shuffle: scale_factor x scale_factor patches become one token
    # "linear": bias-free projection (Idefics3); "mlp": linear, GeLU, linear (LLaVA);
    # "rms_norm_linear": Gemma's RMSNorm, then a bias-free projection (Gemma 3)
    connector: str = "linear"
    pool_kernel: int = 1  # average pool: pool_kernel x pool_kernel patches become one token (Gemma 3)
    # the text decoder's tokens of one image attend to each other both ways in prefill (Gemma 3)
    bidirectional_image_attention: bool = False
    patch_bias: bool = True  # the patch conv has a bias (not in CLIP)
    class_token: bool = False  # a learned class embedding before the patches (CLIP)
    drop_class_token: bool = False  # ... and left out of the image's embeddings (LLaVA's "default" strategy)
    pre_norm: bool = False  # LayerNorm on the embeddings before the layers (CLIP's `pre_layrnorm`)
    post_norm: bool = True  # LayerNorm after the last layer run (SigLIP's `post_layernorm`)
    qkv_bias: bool = True  # q, k, v projections with bias (InternViT: `attention_bias`)
    layer_scale: bool = False  # residual branches scaled per channel (InternViT's lambda_1, lambda_2)
    projector_norm: bool = False  # LayerNorm before the MLP connector (InternVL)
    # Normalisation of [0, 1] pixels, per channel: (x - mean) / std.
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    def __post_init__(self):
        for name in (
            "image_size",
            "patch_size",
            "dim",
            "n_layers",
            "n_heads",
            "hidden_dim",
            "text_dim",
            "scale_factor",
            "pool_kernel",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"VisionConfig.{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"VisionConfig.dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")
        if self.patches_per_side % (self.scale_factor * self.pool_kernel):
            raise ValueError(
                f"{self.patches_per_side} patches per side do not divide into scale_factor {self.scale_factor} "
                f"x pool_kernel {self.pool_kernel}"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"VisionConfig.activation must be one of {', '.join(ACTIVATIONS)}, got '{self.activation}'"
            )
        if self.connector not in CONNECTORS:
            raise ValueError(f"VisionConfig.connector must be one of {', '.join(CONNECTORS)}, got '{self.connector}'")
        for name in ("image_mean", "image_std"):
            value = tuple(float(v) for v in getattr(self, name))
            if len(value) != 3:
                raise ValueError(f"VisionConfig.{name} needs 3 values (RGB), got {value}")
            object.__setattr__(self, name, value)

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size  # a conv of stride p drops a remainder (384 / 14 -> 27)

    @property
    def positions(self) -> int:
        return self.patches_per_side**2 + self.class_token

    @property
    def tokens_per_image(self) -> int:
        class_token = self.class_token and not self.drop_class_token
        return (self.patches_per_side // (self.scale_factor * self.pool_kernel)) ** 2 + class_token

    @property
    def num_params(self) -> int:
        d, p, t = self.dim, self.patch_size, self.text_dim
        embed = 3 * p * p * d + self.patch_bias * d + self.positions * d + self.class_token * d
        layer = 4 * (d * d + d) + 2 * d * self.hidden_dim + self.hidden_dim + d + 4 * d
        layer += 2 * d * self.layer_scale - 3 * d * (not self.qkv_bias)
        norms = 2 * d * (self.pre_norm + self.post_norm)
        shuffled = d * self.scale_factor**2
        connector = {
            "linear": shuffled * t,
            "rms_norm_linear": shuffled + shuffled * t,
            "mlp": shuffled * t + t + t * t + t + 2 * shuffled * self.projector_norm,
        }[self.connector]
        return embed + self.n_layers * layer + norms + connector

    @classmethod
    def from_dict(cls, data: dict) -> VisionConfig:
        return cls(**data)


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
    them differ."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        p = config.patch_size
        self.patch_embedding = nn.Conv2d(3, config.dim, kernel_size=p, stride=p, bias=config.patch_bias)
        self.class_embedding = nn.Parameter(torch.zeros(config.dim)) if config.class_token else None
        self.position_embedding = nn.Embedding(config.positions, config.dim)
        self.register_buffer("position_ids", embedding_position_ids(config), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch_embedding(x).flatten(2).transpose(1, 2)  # [1, n*n, dim]
        if self.class_embedding is not None:
            h = torch.cat([self.class_embedding.view(1, 1, -1), h], dim=1)
        return h + self.position_embedding(self.position_ids)


class Attention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.dim // config.n_heads
        self.q_proj = nn.Linear(config.dim, config.dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.dim, config.dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.dim, config.dim, bias=config.qkv_bias)
        self.out_proj = nn.Linear(config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(y.transpose(1, 2).reshape(b, s, -1))


class EncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.self_attn = Attention(config)
        self.layer_norm2 = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.fc1 = nn.Linear(config.dim, config.hidden_dim)
        self.fc2 = nn.Linear(config.hidden_dim, config.dim)
        self.act = ACTIVATIONS[config.activation]
        self.lambda_1 = nn.Parameter(torch.ones(config.dim)) if config.layer_scale else None
        self.lambda_2 = nn.Parameter(torch.ones(config.dim)) if config.layer_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attention = self.self_attn(self.layer_norm1(x))
        x = x + (attention if self.lambda_1 is None else self.lambda_1 * attention)
        mlp = self.fc2(self.act(self.fc1(self.layer_norm2(x))))
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
    """uint8 [1, 3, S, S] -> image embeddings [1, tokens_per_image, text_dim]."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.normalize = Normalize(config)
        self.embeddings = PatchEmbedding(config)
        self.pre_layrnorm = nn.LayerNorm(config.dim, eps=config.norm_eps) if config.pre_norm else nn.Identity()
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_layers))
        self.post_layernorm = nn.LayerNorm(config.dim, eps=config.norm_eps) if config.post_norm else nn.Identity()
        if config.connector == "linear":
            self.projection = nn.Linear(config.dim * config.scale_factor**2, config.text_dim, bias=False)
        elif config.connector == "rms_norm_linear":
            self.projection = RMSNormLinearProjector(config)
        else:
            self.projection = MLPProjector(config)

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """The hidden state the connector reads, for normalised float pixels: [1, positions, dim]."""
        h = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.layers:
            h = layer(h)
        return self.post_layernorm(h)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.features(self.normalize(pixels))
        if self.config.class_token and self.config.drop_class_token:
            h = h[:, 1:]
        if self.config.scale_factor > 1:
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


def with_image_flag(h: torch.Tensor, image: bool) -> torch.Tensor:
    """Embeddings [1, T, D] -> [1, T, D + 1], the last column 1 for an image's rows and 0 for text's.
    ExecuTorch's MultimodalRunner passes `text_decoder` two inputs, the embeddings and the position,
    and feeds each image as a call of its own: a decoder that lets an image's tokens see each other
    both ways (bidirectional_image_attention) learns which rows are an image's from this column,
    which `token_embedding` and `vision_encoder` write and `text_decoder` takes off (split_image_flag)."""
    return torch.cat([h, torch.full_like(h[..., :1], float(image))], dim=-1)


def split_image_flag(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, T, D + 1] -> (embeddings [1, T, D], image flags [1, T]): with_image_flag undone."""
    return h[..., :-1], h[..., -1]


class VisionLanguageModel(nn.Module):
    """The text decoder and the image tower side by side: the one module every method of a
    multimodal program wraps, so the methods name (and share) the same tensors."""

    def __init__(self, decoder: nn.Module, vision: VisionEncoder):
        super().__init__()
        self.decoder, self.vision = decoder, vision
