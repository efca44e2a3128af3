"""The image tower's config: what the one vision encoder (vision.py) is built from, per family.
Plain data (no torch): registry entries and manifests read it without the model."""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATION_NAMES = ("gelu_tanh", "gelu", "quick_gelu", "silu")
CONNECTORS = ("linear", "mlp", "rms_norm_linear", "merger")
NORMS = ("layer", "rms")
MLPS = ("fc", "gated")


@dataclass(frozen=True)
class VisionConfig:
    image_size: int  # S: the encoder's square input, pixels (the merger's: its largest side)
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
        if self.activation not in ACTIVATION_NAMES:
            raise ValueError(
                f"VisionConfig.activation must be one of {', '.join(ACTIVATION_NAMES)}, got '{self.activation}'"
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
