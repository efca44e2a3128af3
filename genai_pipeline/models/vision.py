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
- Qwen2.5-VL's ViT: a bias-free patch conv over `temporal_patch_size` frames (a still image is
  that frame repeated, so the conv is one over the frame with the frames' kernels summed), no
  learned positions but 2D RoPE in every layer (`rope_theta`), RMSNorm (`norm="rms"`), SwiGLU
  MLPs with biases (`mlp="gated"`), attention within `window_size`-pixel windows except in
  `full_attention_layers`, no final norm; the connector (`connector="merger"`) takes each 2 x 2
  block of patches (the tokens run block by block, as Qwen2VLImageProcessor orders them):
  RMSNorm, then linear, GeLU, linear over the block's concatenated features. The input size is
  fixed per program (transformers takes any multiple of 28 px: see image_processing.py).
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

from genai_pipeline.models.decoder import RMSNorm, apply_rope, gelu_tanh


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"gelu_tanh": gelu_tanh, "gelu": F.gelu, "quick_gelu": quick_gelu, "silu": F.silu}
CONNECTORS = ("linear", "mlp", "rms_norm_linear", "merger")
NORMS = ("layer", "rms")
MLPS = ("fc", "gated")


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
    # Qwen2.5-VL (see the module doc)
    norm: str = "layer"  # "layer": LayerNorm; "rms": RMSNorm (no bias)
    mlp: str = "fc"  # "fc": fc2(act(fc1 x)); "gated": down(act(gate x) * up x), all with biases
    learned_positions: bool = True  # a learned position table added to the patches
    rope_theta: float | None = None  # 2D RoPE in every layer (rows, then columns): its base; None: no RoPE
    temporal_patch_size: int = 1  # frames the patch conv spans (a still image repeats its frame)
    window_size: int = 0  # pixels: attention within windows of this side; 0: no windows
    full_attention_layers: tuple[int, ...] = ()  # with window_size: the layers attending over the whole image

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
            "temporal_patch_size",
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
        if self.norm not in NORMS or self.mlp not in MLPS:
            raise ValueError(
                f"VisionConfig.norm / mlp must be one of {NORMS} / {MLPS}, got '{self.norm}' / '{self.mlp}'"
            )
        object.__setattr__(self, "full_attention_layers", tuple(int(i) for i in self.full_attention_layers))
        if self.window_size and self.window_size % (self.patch_size * self.scale_factor):
            raise ValueError(
                f"VisionConfig.window_size ({self.window_size}) must be a multiple of patch_size x scale_factor"
            )
        if self.connector == "merger" and self.image_size % (self.patch_size * self.scale_factor):
            raise ValueError(
                f"the merger connector needs image_size ({self.image_size}) a multiple of patch_size x scale_factor "
                f"({self.patch_size * self.scale_factor})"
            )
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
        d, p, t, f = self.dim, self.patch_size, self.text_dim, self.hidden_dim
        embed = 3 * self.temporal_patch_size * p * p * d + self.patch_bias * d + self.class_token * d
        embed += self.learned_positions * self.positions * d
        norm = d if self.norm == "rms" else 2 * d
        mlp = 2 * d * f + f + d if self.mlp == "fc" else 3 * d * f + 2 * f + d
        layer = 4 * (d * d + d) + mlp + 2 * norm + 2 * d * self.layer_scale - 3 * d * (not self.qkv_bias)
        norms = 2 * d * (self.pre_norm + self.post_norm)
        shuffled = d * self.scale_factor**2
        connector = {
            "linear": shuffled * t,
            "rms_norm_linear": shuffled + shuffled * t,
            "mlp": shuffled * t + t + t * t + t + 2 * shuffled * self.projector_norm,
            "merger": d + shuffled * shuffled + shuffled + shuffled * t + t,
        }[self.connector]
        return embed + self.n_layers * layer + norms + connector

    @classmethod
    def from_dict(cls, data: dict) -> VisionConfig:
        return cls(**data)


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


class TemporalPatchConv(nn.Module):
    """Qwen2.5-VL's Conv3d patch embedding (kernel = stride = [frames, p, p], no bias) on a still
    image, whose frames are all the same: the sum of the frames' kernels as one Conv2d."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        p = self.patch_size = config.patch_size
        self.weight = nn.Parameter(torch.zeros(config.dim, 3, config.temporal_patch_size, p, p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight.sum(2), stride=self.patch_size)


def block_order(n: int, scale: int) -> torch.Tensor:
    """[n*n]: the row-major patch index of each token when tokens run `scale` x `scale` block by
    block (blocks row-major, row-major within a block), as Qwen2VLImageProcessor orders patches."""
    index = torch.arange(n * n).view(n // scale, scale, n // scale, scale)
    return index.permute(0, 2, 1, 3).reshape(-1)


class PatchEmbedding(nn.Module):
    """Conv patches (after a class token, for CLIP) plus learned positions. Idefics3 buckets
    fractional patch coordinates into the position table to allow other sizes; for the full square
    input that is the identity, computed here once with the same ops so float rounding cannot make
    them differ. Qwen2.5-VL: no positions here (RoPE in the layers), patches in merge-block order."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        p = config.patch_size
        if config.temporal_patch_size > 1:
            self.patch_embedding = TemporalPatchConv(config)
        else:
            self.patch_embedding = nn.Conv2d(3, config.dim, kernel_size=p, stride=p, bias=config.patch_bias)
        self.class_embedding = nn.Parameter(torch.zeros(config.dim)) if config.class_token else None
        self.position_embedding = nn.Embedding(config.positions, config.dim) if config.learned_positions else None
        self.register_buffer("position_ids", embedding_position_ids(config), persistent=False)
        merger = config.connector == "merger"
        order = block_order(config.patches_per_side, config.scale_factor) if merger else None
        self.register_buffer("token_order", order, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch_embedding(x).flatten(2).transpose(1, 2)  # [1, n*n, dim]
        if self.token_order is not None:
            h = h[:, self.token_order]
        if self.class_embedding is not None:
            h = torch.cat([self.class_embedding.view(1, 1, -1), h], dim=1)
        return h if self.position_embedding is None else h + self.position_embedding(self.position_ids)


def rope_2d_tables(config: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [1, tokens, 1, head_dim] of Qwen2.5-VL's 2D RoPE, tokens in merge-block order:
    a quarter of the head's frequencies turn with the patch's row, the next quarter with its
    column, the second half repeats the first (rotate-half form); float32, as transformers."""
    n, head_dim = config.patches_per_side, config.dim // config.n_heads
    order = block_order(n, config.scale_factor)
    rows, cols = (order // n).float(), (order % n).float()
    half = head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)[None, :, None]
    return angles.cos(), angles.sin()


def window_mask(config: VisionConfig) -> torch.Tensor:
    """Additive [tokens, tokens]: 0 between tokens of the same window, -inf otherwise. Windows are
    `window_size` px squares from the top-left (the last ones cut by the image's edge), as
    transformers' `get_vision_window_index` groups the merged tokens."""
    merged = config.patches_per_side // config.scale_factor
    side = config.window_size // (config.patch_size * config.scale_factor)  # merged tokens per window side
    unit = torch.arange(merged * merged).repeat_interleave(config.scale_factor**2)  # each token's merged token
    window = (unit // merged) // side * merged + (unit % merged) // side
    same = window[:, None] == window[None, :]
    return torch.zeros(same.shape).masked_fill(~same, float("-inf"))


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


class GatedMLP(nn.Module):
    """Qwen2.5-VL's vision MLP: down(act(gate x) * up x), every linear with a bias."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.hidden_dim)
        self.up_proj = nn.Linear(config.dim, config.hidden_dim)
        self.down_proj = nn.Linear(config.hidden_dim, config.dim)
        self.act = ACTIVATIONS[config.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class EncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layer_norm1 = norm_layer(config, config.dim)
        self.self_attn = Attention(config)
        self.layer_norm2 = norm_layer(config, config.dim)
        gated = config.mlp == "gated"
        self.mlp = GatedMLP(config) if gated else None
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


class PatchMerger(nn.Module):
    """Qwen2.5-VL's connector: RMSNorm per patch, then each block of scale² patches (consecutive
    tokens) concatenated through linear, GeLU, linear."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.width = config.dim * config.scale_factor**2
        self.ln_q = RMSNorm(config.dim, config.norm_eps)
        self.linear_1 = nn.Linear(self.width, self.width)
        self.linear_2 = nn.Linear(self.width, config.text_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_q(x).reshape(x.shape[0], -1, self.width)
        return self.linear_2(F.gelu(self.linear_1(h)))


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
            self.projection = PatchMerger(config)
        # which layers attend within windows (Qwen2.5-VL); the others see every token
        self.layer_windowed = tuple(
            bool(config.window_size) and i not in config.full_attention_layers for i in range(config.n_layers)
        )
        self._set_tables()

    def _set_tables(self) -> None:
        config = self.config
        rope = rope_2d_tables(config) if config.rope_theta is not None else (None, None)
        self.register_buffer("rope_cos", rope[0], persistent=False)
        self.register_buffer("rope_sin", rope[1], persistent=False)
        self.register_buffer("window_mask", window_mask(config) if any(self.layer_windowed) else None, persistent=False)

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """The hidden state the connector reads, for normalised float pixels: [1, positions, dim]."""
        h = self.pre_layrnorm(self.embeddings(pixels))
        rope = None if self.rope_cos is None else (self.rope_cos, self.rope_sin)
        for layer, windowed in zip(self.layers, self.layer_windowed):
            h = layer(h, rope, self.window_mask if windowed else None)
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
        if self.embeddings.token_order is not None:
            self.embeddings.token_order = block_order(self.config.patches_per_side, self.config.scale_factor)
        self._set_tables()


def unused_tower_tensor(name: str, config: VisionConfig) -> bool:
    """A checkpoint tensor of the tower (our name) the encoder never reads: a layer after the one
    the connector reads, or the final norm when it reads an earlier layer (LLaVA)."""
    layer = re.match(r"vision\.layers\.(\d+)\.", name)
    return (layer is not None and int(layer[1]) >= config.n_layers) or (
        not config.post_norm and name.startswith("vision.post_layernorm.")
    )


class MRopeCursor(nn.Module):
    """M-RoPE positions inside the program, from what `text_decoder` is given: the embeddings'
    image-flag column (with_image_flag) says which rows are an image's, each image a run of g x g
    rows, whole within a call (ExecuTorch's MultimodalRunner feeds each image in a call of its own;
    our runtime puts them in the prompt's call). An image's rows sit at one temporal position with
    their rows and columns counted from it, and the text after it continues g positions later, not
    g² (transformers' `get_rope_index`). `rope_shift`, per cache row, is how far the M-RoPE
    position of the text after that row lags its cache position: a mutable buffer of text_decoder
    alone, written as the KV cache is, so a call at any position (a new conversation at 0, a
    rewind) reads the shift of the rows before it. Tensor ops only: one trace serves every call."""

    def __init__(self, max_seq_len: int, grid: int):
        super().__init__()
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (llama.update_cache)

        self.grid = grid  # an image's tokens per side
        self.register_buffer("rope_shift", torch.zeros(1, max_seq_len, 1, 1), persistent=False)

    def forward(self, input_pos: torch.Tensor, image_rows: torch.Tensor) -> torch.Tensor:
        """The [3, T] positions of a call at cache position input_pos[0] whose rows are an image's
        where image_rows [1, T] is 1; records the shift after each row."""
        seq_len = image_rows.size(1)
        start = input_pos[0].item()
        torch._check(start >= 0)
        torch._check(start + seq_len <= self.rope_shift.size(1))
        g, n = self.grid, self.grid * self.grid
        before = torch.clamp(input_pos - 1, min=0)
        shift = (torch.index_select(self.rope_shift.view(-1), 0, before) * (input_pos > 0)).to(torch.long)  # [1]
        flags = (image_rows[0] > 0.5).to(torch.long)  # [T]
        seen = torch.cumsum(flags, 0) - flags  # image rows before each row, in this call
        index = (seen % n) * flags  # a row's place in its image; 0 for text
        images_before = seen // n
        base = input_pos + torch.arange(seq_len) - index - shift - images_before * (n - g)
        positions = torch.stack([base, base + index // g, base + index % g])
        after = shift + ((seen + flags) // n) * (n - g)  # the shift of the text after each row
        torch.ops.llama.update_cache(after.to(torch.float32).view(1, -1, 1, 1), self.rope_shift, start)
        return positions

    def reset_buffers(self) -> None:
        self.rope_shift = torch.zeros(self.rope_shift.shape)


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
    multimodal program wraps, so the methods name (and share) the same tensors. With M-RoPE
    (Qwen2.5-VL) the positions' cursor too (MRopeCursor)."""

    def __init__(self, decoder: nn.Module, vision: VisionEncoder):
        super().__init__()
        self.decoder, self.vision = decoder, vision
        grid = vision.config.patches_per_side // vision.config.scale_factor
        self.mrope = MRopeCursor(decoder.max_seq_len, grid) if decoder.config.mrope_section else None

    def image_flagged(self) -> bool:
        """Whether the program's embeddings carry the image-flag column (with_image_flag): its
        text decoder must know an image's rows, for their masks (Gemma 3) or positions (M-RoPE)."""
        return self.vision.config.bidirectional_image_attention or self.mrope is not None

    def decode(
        self,
        embeddings: torch.Tensor,
        input_pos: torch.Tensor,
        last_only: bool = True,
        image_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder on embeddings [1, T, D] whose rows are an image's where image_tokens [1, T]
        is 1 (None: none are): that decides Gemma 3's masks, or the M-RoPE positions."""
        positions = None
        if self.mrope is not None:
            rows = image_tokens if image_tokens is not None else embeddings.new_zeros(embeddings.shape[:2])
            positions = self.mrope(input_pos, rows)
        masks = image_tokens if self.vision.config.bidirectional_image_attention else None
        return self.decoder.forward_embeddings(
            embeddings, input_pos, last_only, image_tokens=masks, rope_positions=positions
        )
