"""The one export-friendly decoder: every supported model is this file plus a DecoderConfig.

Read top to bottom: config, RoPE, norm and masks, KV cache, attention, MLP, block, decoder.

Export notes (why it looks the way it does):
- Positions come in explicitly (`input_pos`, shape [1]: the position of the first token); no
  Python control flow depends on data, so one trace serves every call. The branches below
  depend on the config only.
- The KV cache is a pair of buffers per layer in ExecuTorch's `[B, S, H, D]` layout, written by
  `llama.update_cache` and read by `llama.custom_sdpa`; a plain `index_copy_` cache lowers to a
  whole-cache copy per call. Attention is causal from `start`, so padding after the last real
  token of a chunk never changes a real token's output, and the next write overwrites it.
  Sliding-window layers pass `custom_sdpa` a float mask over the whole cache instead, built
  from `start` with tensor ops, so it too has no data-dependent control flow.
- RoPE uses the Hugging Face "rotate half" convention, so HF checkpoints load without permuting
  q/k weights.

The cache-I/O form (`Decoder.forward_cache_io`, QNN's form, as Qualcomm's static llama): the same
layers and weights, but the KV cache is graph I/O and positions are data, never shapes or Python
ints. Past keys/values come in per layer as `[1, n_kv_heads, max_seq_len, head_dim]` (rows past
the runtime's cursor are garbage), this call's rows go out as `[1, n_kv_heads, T, head_dim]` and
the runtime writes them into its buffers; RoPE rows are gathered by a `positions` tensor; which
cache rows and which of this call's rows each token sees is an additive `mask` input
`[1, 1, T, max_seq_len + T]` (0 seen, MASK_HIDDEN hidden). Attention is plain matmul + softmax:
no `.item()`, no custom op, nothing shaped by data (models/cache_io.py has the contract and its driver).

Family switches (all off by default: a Llama config is unchanged by them):
- Qwen 2: `qkv_bias`. Qwen 3: `qk_norm`. SmolLM3: `nope_layers` (no RoPE in some layers).
- Granite 3: `embedding_multiplier`, `residual_multiplier`, `attention_scale`, `logit_divisor`.
- OLMo 2: `pre_norms=False` with `sandwich_norms` (norms after attention and MLP only),
  `qk_norm_across_heads` (q and k normed over the whole projection, not per head).
- Mistral / Ministral: sliding-window layers.
- LFM2: `conv_layers` hold a gated short convolution (`ShortConv`) instead of attention; its
  state is a cache by position like the KV cache (`ConvCache`), a mutable buffer of the program.
- Phi-3/4: `rope_dim` (partial rotary), `LongRopeScaling`; fused checkpoint tensors are split by
  the loader, so the decoder keeps separate wq/wk/wv and w1/w3.
- Qwen2.5-VL: `mrope_section` (M-RoPE): the rotary frequencies in three runs, turned by a token's
  temporal, height and width position; `rope_positions` [3, T] gives them (the same three for a
  text token, so without them, or for text, it is plain RoPE). Rows of the one RoPE table are
  gathered per run: no position becomes a shape.
- Gemma 3: `scale_embeddings`, `activation="gelu_tanh"`, `norm_unit_offset`, `sandwich_norms`,
  `qk_norm`, `attention_scale`, sliding-window layers with their own `rope_local_theta`,
  `final_logit_softcap`; `LinearRopeScaling` (4B and up). Gemma 3 with images: the tokens of one
  image see each other both ways in prefill (`forward_embeddings(..., image_tokens=...)`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GeLU, tanh approximation (transformers' `gelu_pytorch_tanh`), spelled out: ExecuTorch 1.5.1's
    XNNPACK partitioner lowers `F.gelu(x, approximate="tanh")` as the exact (erf) GeLU."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


# The gate activation of the gated MLP, by DecoderConfig.activation.
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh}


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling of RoPE (`rope_type: llama3` in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    @property
    def attention_factor(self) -> float:
        return 1.0

    def scale(self, inv_freq: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        # Keep high frequencies, divide low ones by `factor`, blend in between.
        low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation (`rope_type: linear`): every frequency divided by `factor` (Gemma 3's
    global layers from 4B up)."""

    factor: float

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"linear RoPE factor must be positive, got {self.factor}")

    @property
    def attention_factor(self) -> float:
        return 1.0

    def scale(self, inv_freq: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        return inv_freq / self.factor


@dataclass(frozen=True)
class LongRopeScaling:
    """Phi-3/Phi-4 LongRoPE (`rope_type: longrope`): one divisor per frequency, and cos/sin
    multiplied by `attention_factor`.

    transformers picks `short_factor` while the sequence fits `original_max_position_embeddings`
    and `long_factor` beyond it, re-deciding at every call. A program has one static RoPE table,
    so the choice is made once from the cache length: `short_factor` when `max_seq_len` fits the
    original context (identical to transformers), `long_factor` otherwise (what transformers uses
    once a sequence is longer than the original context; llama.cpp decides the same way).
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float

    def __post_init__(self):
        object.__setattr__(self, "short_factor", tuple(float(f) for f in self.short_factor))
        object.__setattr__(self, "long_factor", tuple(float(f) for f in self.long_factor))
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(
                f"longrope short_factor ({len(self.short_factor)}) and long_factor ({len(self.long_factor)}) differ in length"
            )
        if min(self.short_factor + self.long_factor) <= 0 or self.attention_factor <= 0:
            raise ValueError("longrope factors and attention_factor must be positive")

    def scale(self, inv_freq: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        long = max_seq_len > self.original_max_position_embeddings
        factors = torch.tensor(self.long_factor if long else self.short_factor, dtype=inv_freq.dtype)
        return inv_freq / factors


def _check_layers(name: str, layers: tuple[int, ...], n_layers: int) -> None:
    if list(layers) != sorted(set(layers)) or any(not 0 <= i < n_layers for i in layers):
        raise ValueError(
            f"DecoderConfig.{name} must list distinct layer indices in [0, {n_layers}) in order, got {layers}"
        )


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    head_dim: int = 0  # 0: dim // n_heads
    norm_eps: float = 1e-5
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight) (Gemma)
    sandwich_norms: bool = False  # also normalise the attention and MLP outputs before the residual add (Gemma)
    pre_norms: bool = True  # normalise the attention and MLP inputs; False: their outputs only (OLMo 2)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | LongRopeScaling | LinearRopeScaling | None = None
    rope_dim: int = 0  # dims of each head that RoPE rotates, the first ones; 0: all (Phi: partial_rotary_factor)
    mrope_section: tuple[int, ...] = ()  # M-RoPE (Qwen2.5-VL): frequencies per temporal / height / width run
    nope_layers: tuple[int, ...] = ()  # layers without RoPE (SmolLM3)
    conv_layers: tuple[int, ...] = ()  # layers with a gated short convolution instead of attention (LFM2)
    conv_kernel: int = 3  # the positions that convolution reads, its own included (LFM2's conv_L_cache)
    sliding_window: int | None = None  # tokens a sliding-window layer sees, itself included
    sliding_window_layers: tuple[int, ...] = ()  # layers with sliding-window attention
    rope_local_theta: float | None = None  # RoPE base of the sliding-window layers (Gemma 3); None: rope_theta
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    qk_norm_across_heads: bool = False  # with qk_norm: over all heads of q (of k) at once (OLMo 2)
    attention_scale: float | None = None  # None: 1 / sqrt(head_dim) (Gemma 3: query_pre_attn_scalar ** -0.5)
    activation: str = "silu"  # gate activation of the MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    scale_embeddings: bool = False  # token embeddings times sqrt(dim) (Gemma)
    embedding_multiplier: float = 1.0  # token embeddings times this (Granite)
    residual_multiplier: float = 1.0  # attention and MLP outputs times this before the residual add (Granite)
    logit_divisor: float = 1.0  # logits divided by this (Granite's logits_scaling)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    tie_embeddings: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self):
        # Checkpoint metadata arrives here from files users download: types are checked, not assumed.
        for field in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "hidden_dim",
            "max_position_embeddings",
            "head_dim",
            "rope_dim",
            "sliding_window",
            "conv_kernel",
        ):
            value, least = getattr(self, field), 0 if field in ("head_dim", "rope_dim") else 1  # 0: derived
            if (value is not None or field != "sliding_window") and not (_whole(value) and value >= least):
                raise ValueError(f"DecoderConfig.{field} must be a whole number >= {least}, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ValueError(f"dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.rope_dim == 0:
            object.__setattr__(self, "rope_dim", self.head_dim)
        self._check_rope()
        self._check_layer_kinds()
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"DecoderConfig.activation must be one of {', '.join(ACTIVATIONS)}, got '{self.activation}'"
            )
        for field in (
            "norm_eps",
            "rope_theta",
            "rope_local_theta",
            "attention_scale",
            "final_logit_softcap",
            "embedding_multiplier",
            "residual_multiplier",
            "logit_divisor",
        ):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < math.inf):  # NaN too
                raise ValueError(f"DecoderConfig.{field} must be a finite number above 0, got {value!r}")
        if not (self.pre_norms or self.sandwich_norms):
            raise ValueError("DecoderConfig.pre_norms=False needs sandwich_norms: a block without any norm")
        if self.qk_norm_across_heads and not self.qk_norm:
            raise ValueError("DecoderConfig.qk_norm_across_heads needs qk_norm")

    def _check_rope(self) -> None:
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even and in (0, head_dim={self.head_dim}], got {self.rope_dim}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if self.mrope_section and (len(self.mrope_section) != 3 or sum(self.mrope_section) != self.rope_dim // 2):
            raise ValueError(
                f"mrope_section must be 3 runs of frequencies adding up to rope_dim / 2 = {self.rope_dim // 2}, "
                f"got {self.mrope_section}"
            )
        if isinstance(self.rope_scaling, LongRopeScaling) and len(self.rope_scaling.short_factor) != self.rope_dim // 2:
            raise ValueError(
                f"longrope needs rope_dim / 2 = {self.rope_dim // 2} factors, got {len(self.rope_scaling.short_factor)}"
            )

    def _check_layer_kinds(self) -> None:
        for field in ("nope_layers", "sliding_window_layers", "conv_layers"):
            object.__setattr__(self, field, tuple(getattr(self, field)))
            _check_layers(field, getattr(self, field), self.n_layers)
        if (self.sliding_window is None) != (not self.sliding_window_layers):
            raise ValueError("sliding_window and sliding_window_layers must be set together")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")
        if self.rope_local_theta is not None and (not self.sliding_window_layers or self.rope_local_theta <= 0):
            raise ValueError(
                "rope_local_theta must be positive and needs sliding_window_layers (the layers it applies to)"
            )

    def layer_rope(self, layer: int) -> str | None:
        """Which RoPE table a layer uses: "global", "local" (sliding-window layers with their own
        base) or None (no RoPE; a convolution layer has no use for one)."""
        if layer in self.nope_layers or layer in self.conv_layers:
            return None
        if self.rope_local_theta is not None and layer in self.sliding_window_layers:
            return "local"
        return "global"

    @classmethod
    def from_dict(cls, data: dict) -> DecoderConfig:
        """The inverse of `dataclasses.asdict`, e.g. a manifest's `config` read back from JSON."""
        data = dict(data)
        scaling = data.get("rope_scaling")
        if scaling:
            kinds = {"short_factor": LongRopeScaling, "low_freq_factor": RopeScaling}
            kind = next((k for key, k in kinds.items() if key in scaling), LinearRopeScaling)
            data["rope_scaling"] = kind(**scaling)
        for name in ("nope_layers", "sliding_window_layers", "conv_layers", "mrope_section"):
            if name in data:
                data[name] = tuple(data[name])
        return cls(**data)

    @property
    def num_params(self) -> int:
        d, hd = self.dim, self.head_dim
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        attn = d * (q + 2 * kv) + q * d
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += q + kv if self.qk_norm_across_heads else 2 * hd
        norms = (2 * self.pre_norms + 2 * self.sandwich_norms) * d
        conv = 3 * d * d + d * d + d * self.conv_kernel  # in_proj, out_proj, the depthwise kernel
        mixers = (self.n_layers - len(self.conv_layers)) * attn + len(self.conv_layers) * conv
        block = 3 * d * self.hidden_dim + norms
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + mixers + self.n_layers * block + d + head


def rope_inverse_frequencies(config: DecoderConfig, max_seq_len: int, local: bool = False) -> torch.Tensor:
    """[rope_dim / 2] in float64; `local`: the sliding-window layers' base, never scaled (Gemma 3)."""
    theta = config.rope_local_theta if local else config.rope_theta
    dim = config.rope_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if local or config.rope_scaling is None:
        return inv_freq
    return config.rope_scaling.scale(inv_freq, max_seq_len)


def rope_tables(config: DecoderConfig, max_seq_len: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [max_seq_len, rope_dim], halves repeated as in HF's `rotate_half` form."""
    angles = torch.outer(
        torch.arange(max_seq_len, dtype=torch.float64), rope_inverse_frequencies(config, max_seq_len, local)
    )
    angles = torch.cat([angles, angles], dim=-1)
    factor = 1.0 if local or config.rope_scaling is None else config.rope_scaling.attention_factor
    return (angles.cos() * factor).float(), (angles.sin() * factor).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, swap: torch.Tensor | None = None) -> torch.Tensor:
    """x: [B, S, H, D]; cos, sin: [1, S, 1, R]. Rotates the first R dims of each head; the rest pass.
    swap: None, or half_swap_matrix(D) to swap the halves as a matmul instead of slices."""
    r, d = cos.size(-1), x.size(-1)
    if r < d:  # partial rotary (Phi): a static shape check, not data
        return torch.cat([apply_rope(x[..., :r], cos, sin, swap), x[..., r:]], dim=-1)
    if swap is not None:
        return x * cos + F.linear(x, swap) * sin
    # Slices, not chunk/split: XNNPACK takes static slices into the delegate, where a split
    # would end it and cost a delegate call per q and k in every layer.
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def half_swap_matrix(d: int) -> torch.Tensor:
    """W with F.linear(x, W) = cat(-x[d/2:], x[:d/2]), exactly (one +-1 per row, zeros elsewhere)."""
    h = d // 2
    w = torch.zeros(d, d)
    w[torch.arange(h), torch.arange(h) + h] = -1.0
    w[torch.arange(h) + h, torch.arange(h)] = 1.0
    return w


def hadamard_blocks(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x (I (x) h) over x's last dimension: each run of h's size times h (symmetric), as one linear
    over a 2-D view: XNNPACK keeps it inside its delegate (quantize/rotation.py rotate_inputs)."""
    return F.linear(x.reshape(-1, h.shape[0]), h).reshape(x.shape)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, or * (1 + weight) with `unit_offset` (Gemma; its weight starts at 0)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.mean_weights: torch.Tensor | None = None  # see mean_by_matmul
        self.eps_bias: torch.Tensor | None = None
        # set by quantize/rotation.py rotate_inputs: see hadamard_blocks (not persistent: no checkpoint has it)
        self.register_buffer("rotation", None, persistent=False)

    def mean_by_matmul(self) -> None:
        """Take the mean of squares as a product with a constant [1, dim] row of 1/dim: XNNPACK
        keeps a linear inside its delegate but runs no mean over the last dim of a 3-D tensor,
        so the plain form ends the delegate twice per layer (a delegate call costs ~8 us). The
        linear's bias adds eps: no float literal is left for lowering to turn into a tensor
        (a whole-graph re-trace)."""
        self.mean_weights = torch.full((1, self.weight.numel()), 1.0 / self.weight.numel())
        self.eps_bias = torch.full((1,), self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean_weights is None:
            mean_square = x.pow(2).mean(-1, keepdim=True) + self.eps
        else:
            mean_square = F.linear(x * x, self.mean_weights, self.eps_bias)
        x = x * torch.rsqrt(mean_square)
        x = x * (1.0 + self.weight) if self.unit_offset else x * self.weight
        return x if self.rotation is None else hadamard_blocks(x, self.rotation)


def sliding_window_mask(start, seq_len: int, cache_len: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [seq_len, cache_len]: the token at position p = start + i sees cache rows j
    with p - window < j <= p (itself and the window - 1 tokens before it), as in transformers."""
    pos = torch.arange(seq_len).unsqueeze(1) + start
    rows = torch.arange(cache_len).unsqueeze(0)
    visible = (rows <= pos) & (rows > pos - window)
    return torch.zeros(seq_len, cache_len, dtype=dtype).masked_fill(~visible, float("-inf"))


def image_block_masks(
    image_tokens: torch.Tensor, start, seq_len: int, cache_len: int, window: int | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Additive masks [seq_len, cache_len] for a call holding images (Gemma 3's token_type_ids mask):
    causal as usual, and a token of an image also sees the tokens of the same image after it. An
    image is a run of consecutive image tokens of this call (`image_tokens` [1, seq_len], 1 where a
    token is an image's, else 0); a run split across calls is two images. Returns (the full-attention
    layers' mask, the sliding-window layers' mask or None): transformers' OR(causal, same image), and
    AND(window, OR(causal, same image)). Tensor ops only, as sliding_window_mask."""
    is_image = image_tokens[0] > 0.5
    # Two image tokens are of one image when no text token lies between them: when as many text
    # tokens come before each (no shifted copy of the flags, which would pin the length at export)
    image = torch.where(is_image, torch.cumsum((~is_image).to(torch.int32), dim=0), -1)  # -1: text
    pos = torch.arange(seq_len) + start
    rows = torch.arange(cache_len)
    at = pos.unsqueeze(1) == rows.unsqueeze(0)  # [seq_len, cache_len]: where this call's tokens land
    row_image = (at.to(torch.int32) * (image + 2).unsqueeze(1)).sum(0) - 2  # each cache row's; -2: not this call's
    same_image = (image.unsqueeze(1) == row_image.unsqueeze(0)) & (image.unsqueeze(1) >= 0)
    visible = (rows.unsqueeze(0) <= pos.unsqueeze(1)) | same_image

    def additive(seen: torch.Tensor) -> torch.Tensor:
        return torch.zeros(seq_len, cache_len, dtype=dtype).masked_fill(~seen, float("-inf"))

    windowed = None if window is None else additive(visible & (rows.unsqueeze(0) > pos.unsqueeze(1) - window))
    return additive(visible), windowed


class KVCache(nn.Module):
    """Static cache, [1, max_seq_len, n_kv_heads, head_dim]; a mutable buffer in the program."""

    def __init__(self, max_seq_len: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        # torch.ops.llama.update_cache / custom_sdpa (here and in Attention), registered with the first
        # cache, not on import: they bring torch._inductor, which a process that only runs programs
        # (and imports this module for the configs) does not need
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401

        shape = (1, max_seq_len, n_kv_heads, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        torch.ops.llama.update_cache(k, self.k_cache, start)
        torch.ops.llama.update_cache(v, self.v_cache, start)


class ConvCache(nn.Module):
    """A short convolution's state, kept as the KV cache is: its input rows by position,
    [1, kernel - 1 + max_seq_len, 1, dim], after kernel - 1 rows of zeros (the inputs before
    position 0, never written); a mutable buffer in the program, shared by its methods. Kept by
    position rather than as the last kernel - 1 rows for the KV cache's reasons: a chunk padded
    past its last real token writes rows the next call overwrites, and a call at any position (a
    new conversation at 0, a rollback) finds the rows before it; no reset is needed."""

    def __init__(self, max_seq_len: int, dim: int, kernel: int):
        super().__init__()
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (see KVCache)

        self.kernel = kernel
        self.register_buffer("conv_cache", torch.zeros(1, kernel - 1 + max_seq_len, 1, dim), persistent=False)

    def window(self, x: torch.Tensor, start) -> torch.Tensor:
        """x [1, T, dim] at positions start ...: written, and returned after the kernel - 1 rows
        before it, [1, kernel - 1 + T, dim]."""
        torch.ops.llama.update_cache(x.unsqueeze(2), self.conv_cache, start + self.kernel - 1)
        return self.conv_cache.narrow(1, start, x.size(1) + self.kernel - 1).squeeze(2)


class ShortConv(nn.Module):
    """LFM2's gated short convolution, in place of attention: B, C, x = in_proj(h), then
    out_proj(C * conv(B * x)), the convolution depthwise and causal over `conv_kernel` positions.
    Taken as shifted products, not conv1d: elementwise ops any backend takes."""

    def __init__(self, config: DecoderConfig, max_seq_len: int):
        super().__init__()
        d, self.kernel = config.dim, config.conv_kernel
        self.in_proj = nn.Linear(d, 3 * d, bias=False)
        self.out_proj = nn.Linear(d, d, bias=False)
        self.conv_weight = nn.Parameter(torch.zeros(d, 1, self.kernel))  # nn.Conv1d's layout, depthwise
        self.conv_cache = ConvCache(max_seq_len, d, self.kernel)

    def forward(self, x: torch.Tensor, start, rope, mask, rows=None) -> torch.Tensor:
        """As Attention.forward (rope and mask unused); no cache-I/O form (prepare refuses it)."""
        d, t = x.size(-1), x.size(1)
        y = self.in_proj(x)  # slices, not chunk: see apply_rope
        gate_in, gate_out, h = y[..., :d], y[..., d : 2 * d], y[..., 2 * d :]
        window = self.conv_cache.window(gate_in * h, start)
        w = self.conv_weight[:, 0]  # [d, kernel]
        conv = window[:, :t] * w[:, 0]
        for i in range(1, self.kernel):
            conv = conv + window[:, i : i + t] * w[:, i]
        return self.out_proj(gate_out * conv)


# The cache-I/O form's additive mask value for hidden columns (Qualcomm's PADDING_MASK_VALUE):
# exp(-255) underflows to 0 in float32, and a 16-bit quantized mask keeps a fine step.
MASK_HIDDEN = -255.0


@dataclass
class CacheRows:
    """One layer's KV cache as graph I/O (the cache-I/O form): the past rows and the mask come in;
    the layer records this call's rows in `k_new` / `v_new`, which the graph returns."""

    k_past: torch.Tensor  # [1, n_kv_heads, max_seq_len, head_dim]
    v_past: torch.Tensor
    mask: torch.Tensor  # [1, 1, T, max_seq_len + T]: columns are the past rows, then this call's
    k_new: torch.Tensor | None = None  # [1, n_kv_heads, T, head_dim]
    v_new: torch.Tensor | None = None


def fused_linear(linears: list[nn.Linear], concat: Callable) -> nn.Linear | None:
    """One linear whose output is the outputs of `linears` (which read the same input) side by
    side, or None. concat(weights) -> their rows as one weight (float or quantized alike), or None
    when they cannot share one kernel. Fusing them saves a matmul and its activation quantization
    per token (XNNPACK, measured: docs/decisions/0018)."""
    weight = concat([m.weight for m in linears])
    if weight is None:
        return None
    with torch.device("meta"):
        fused = nn.Linear(
            linears[0].in_features, sum(m.out_features for m in linears), bias=linears[0].bias is not None
        )
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if fused.bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias.detach() for m in linears]), requires_grad=False)
    return fused


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[1, n_kv_heads, S, D] -> [1, n_kv_heads * n_rep, S, D], each KV head serving n_rep query heads.
    Static slices and one cat: expand + reshape (Qualcomm's form) leaves torch.export a guard on a
    dynamic row count it cannot prove, so the quantize graph (dynamic T) would not export."""
    if n_rep == 1:
        return x
    return torch.cat([x[:, h : h + 1] for h in range(x.size(1)) for _ in range(n_rep)], dim=1)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, max_seq_len: int):
        super().__init__()
        c, hd = config, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim, self.scale = c.n_heads, c.n_kv_heads, hd, c.attention_scale
        self.wq = nn.Linear(c.dim, c.n_heads * hd, bias=c.qkv_bias)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * hd, bias=c.qkv_bias)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * hd, bias=c.qkv_bias)
        self.wo = nn.Linear(c.n_heads * hd, c.dim, bias=False)
        # per head, or over all heads of the projection at once (OLMo 2: before the split into heads)
        self.qk_norm_across_heads = c.qk_norm_across_heads
        q_size, k_size = (c.n_heads * hd, c.n_kv_heads * hd) if c.qk_norm_across_heads else (hd, hd)
        self.q_norm = RMSNorm(q_size, c.norm_eps, c.norm_unit_offset) if c.qk_norm else None
        self.k_norm = RMSNorm(k_size, c.norm_eps, c.norm_unit_offset) if c.qk_norm else None
        self.kv_cache = KVCache(max_seq_len, c.n_kv_heads, hd)
        self.fused: nn.Linear | None = None  # see fuse
        self.register_buffer("wo_rotation", None, persistent=False)  # wo's input rotated: see RMSNorm.rotation

    def fuse(self, concat: Callable) -> None:
        """wq and wk as one linear, with wv too when its weight takes the same kernel: one matmul
        where there were two or three (see fused_linear). Prefill and decode share the module:
        a second call finds nothing left to fuse. Not with q/k norms across heads: they norm q and k
        before the split into heads, which a fused output would need sliced and reshaped back."""
        if self.wq is None or self.qk_norm_across_heads:
            return
        for names in (("wq", "wk", "wv"), ("wq", "wk")):
            self.fused = fused_linear([getattr(self, n) for n in names], concat)
            if self.fused is not None:
                for n in names:
                    setattr(self, n, None)
                return

    def project(self, x: torch.Tensor, rope: tuple | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of x, [B, S, heads, head_dim] each; q and k normed and rotated."""
        b, n_q, n_kv, hd = x.size(0), self.n_heads, self.n_kv_heads, self.head_dim
        # v first: the graph runs in this order, and an 8-bit matmul as the last one before
        # custom_sdpa slows the attention at 2 threads (docs/decisions/0018)
        v = self.wv(x) if self.wv is not None else None
        # -1 for the length: XNNPACK delegates no reshape to a symbolic size (a dynamic-length graph)
        if self.fused is None:
            q, k = self.wq(x), self.wk(x)
            if self.qk_norm_across_heads:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = q.reshape(b, -1, n_q, hd), k.reshape(b, -1, n_kv, hd), v.reshape(b, -1, n_kv, hd)
        else:  # one matmul's output split by heads, reshaped first: the reshape of a slice is a copy of symbolic size
            y = self.fused(x)
            y = y.reshape(b, -1, y.shape[-1] // hd, hd)
            qk, v = (y, v.reshape(b, -1, n_kv, hd)) if v is not None else (y[:, :, : n_q + n_kv], y[:, :, n_q + n_kv :])
            if self.q_norm is None:  # q and k rotated as one tensor (the same angles), then split: fewer ops
                qk = apply_rope(qk, *rope) if rope is not None else qk
                return qk[:, :, :n_q], qk[:, :, n_q:], v
            q, k = qk[:, :, :n_q], qk[:, :, n_q:]
        if self.q_norm is not None and not self.qk_norm_across_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def forward(
        self, x: torch.Tensor, start, rope: tuple | None, mask: torch.Tensor | None, rows: CacheRows | None = None
    ) -> torch.Tensor:
        """rope: (cos, sin) at this chunk's positions, None for a layer without RoPE;
        mask: an additive mask over the whole cache (sliding window, an image's tokens), None for
        causal attention over the whole prefix.
        rows: the cache-I/O form (start and mask unused: the cache and mask are in `rows`)."""
        b, s, _ = x.shape
        q, k, v = self.project(x, rope)
        if rows is not None:
            return self._out(self._attend_cache_io(q, k, v, rows).reshape(b, s, -1))
        self.kv_cache.update(k, v, start)
        k_cache, v_cache = self.kv_cache.k_cache, self.kv_cache.v_cache
        if mask is None:  # causal from `start`: token i attends to cache rows [0, start + i]. GQA is native.
            y = torch.ops.llama.custom_sdpa(q, k_cache, v_cache, start, None, 0.0, True, self.scale)
        else:  # the mask spans the whole cache and hides the rows past each token (but an image's own)
            y = torch.ops.llama.custom_sdpa(q, k_cache, v_cache, start, mask, 0.0, False, self.scale)
        return self._out(y.reshape(b, -1, self.n_heads * self.head_dim))

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        return self.wo(y if self.wo_rotation is None else hadamard_blocks(y, self.wo_rotation))

    def _attend_cache_io(self, q, k, v, rows: CacheRows) -> torch.Tensor:
        """Attention over the past rows and this call's, as matmuls and a softmax; returns
        [1, T, n_heads, head_dim] and records this call's rows in `rows`."""
        rows.k_new, rows.v_new = k.transpose(1, 2), v.transpose(1, 2)  # [1, n_kv_heads, T, D]
        n_rep = self.n_heads // self.n_kv_heads
        keys = repeat_kv(torch.cat([rows.k_past, rows.k_new], dim=2), n_rep)
        values = repeat_kv(torch.cat([rows.v_past, rows.v_new], dim=2), n_rep)
        scale = self.scale if self.scale is not None else self.head_dim**-0.5
        scores = torch.matmul(q.transpose(1, 2), keys.transpose(2, 3)) * scale + rows.mask
        y = torch.matmul(torch.softmax(scores, dim=-1), values)  # [1, n_heads, T, D]
        return y.transpose(1, 2)


class FeedForward(nn.Module):
    """Gated MLP: w2(act(w1 x) * w3 x); SwiGLU with SiLU, GeGLU with GeLU."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.act = ACTIVATIONS[config.activation]
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w13: nn.Linear | None = None  # see fuse
        self.register_buffer("w2_rotation", None, persistent=False)  # w2's input rotated: see RMSNorm.rotation

    def fuse(self, concat: Callable) -> None:
        """w1 and w3 as one linear when their weights take the same kernel (see fused_linear)."""
        if self.w1 is not None and (fused := fused_linear([self.w1, self.w3], concat)) is not None:
            self.w13, self.w1, self.w3 = fused, None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is None:
            gated = self.act(self.w1(x)) * self.w3(x)
        else:
            y = self.w13(x)
            n = y.shape[-1] // 2
            gated = self.act(y[..., :n]) * y[..., n:]
        return self.w2(gated if self.w2_rotation is None else hadamard_blocks(gated, self.w2_rotation))


# Each pre-norm and the linears reading its output (submodule names): the norm's scale can move
# into them (quantize/rotation.py, SmoothQuant in quantize/smoothing.py)
NORM_READERS = {
    "attention_norm": ("attention.wq", "attention.wk", "attention.wv"),
    "ffn_norm": ("feed_forward.w1", "feed_forward.w3"),
}


class Block(nn.Module):
    """Attention, or a short convolution (`conv`: LFM2), then the MLP, each added to the residual
    stream after their norms."""

    def __init__(self, config: DecoderConfig, max_seq_len: int, conv: bool = False):
        super().__init__()

        def norm() -> nn.Module:
            return RMSNorm(config.dim, config.norm_eps, config.norm_unit_offset)

        pre_norm = norm if config.pre_norms else nn.Identity
        post_norm = norm if config.sandwich_norms else nn.Identity
        self.norm_readers = NORM_READERS if config.pre_norms else {}  # no pre-norm: no scale to move
        # the linears writing the residual stream (quantize/rotation.py)
        self.residual_writers = ("attention.wo", "feed_forward.w2")
        self.attention_norm = pre_norm()
        self.attention: Attention | None = None
        self.conv: ShortConv | None = None
        if conv:
            self.conv = ShortConv(config, max_seq_len)
            self.norm_readers = {**self.norm_readers, "attention_norm": ("conv.in_proj",)}
            self.residual_writers = ("conv.out_proj", "feed_forward.w2")
        else:
            self.attention = Attention(config, max_seq_len)
        self.attention_post_norm = post_norm()
        self.ffn_norm = pre_norm()
        self.feed_forward = FeedForward(config)
        self.ffn_post_norm = post_norm()
        self.residual_multiplier = config.residual_multiplier

    def forward(
        self, x: torch.Tensor, start, rope: tuple | None, mask: torch.Tensor | None, rows: CacheRows | None = None
    ) -> torch.Tensor:
        mixer = self.attention if self.conv is None else self.conv
        x = x + self._residual(self.attention_post_norm(mixer(self.attention_norm(x), start, rope, mask, rows)))
        return x + self._residual(self.ffn_post_norm(self.feed_forward(self.ffn_norm(x))))

    def _residual(self, h: torch.Tensor) -> torch.Tensor:
        # a branch on the config, not on data: a multiplier of 1 leaves the graph as it was
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier


class Decoder(nn.Module):
    """tokens [1, T] + input_pos [1] -> logits [1, T, vocab] (or [1, vocab] with last_only).

    `forward_embeddings` takes embeddings instead of ids: the multimodal path splices image
    embeddings in front of text embeddings and reuses this same decoder.
    """

    def __init__(self, config: DecoderConfig, max_seq_len: int):
        super().__init__()
        self.config, self.max_seq_len = config, max_seq_len
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, max_seq_len, i in config.conv_layers) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, config.norm_unit_offset)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        # Set by rotation.rotate: the residual stream is x Q (Q = rotation.random_hadamard(dim, seed)),
        # and a tied head reads it through a float d x d linear; None: not rotated
        self.rotation_seed: int | None = None
        self.head_rotation: nn.Linear | None = None
        self.layer_rope = tuple(config.layer_rope(i) for i in range(config.n_layers))
        self.register_buffer("rope_swap", None, persistent=False)  # see swap_rope_halves_by_matmul
        # A window as long as the cache never hides anything: those layers stay plainly causal.
        windowed = config.sliding_window is not None and config.sliding_window < max_seq_len
        self.layer_windowed = tuple(windowed and i in config.sliding_window_layers for i in range(config.n_layers))
        self._set_rope_tables()
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            # The head reads the embedding's storage through a parameter of its own: one table in
            # memory, two graph inputs. With a single shared input, lowering a delegated head beside
            # the portable embedding lookup deep-copies the table once per method (GBs for a 1B model).
            self.output.weight = nn.Parameter(self.tok_embeddings.weight.detach(), requires_grad=False)

    def fuse_projections(self, concat: Callable) -> None:
        """In every block, the linears that read the same input as one linear where their weights
        take the same kernel (Attention.fuse, FeedForward.fuse); the same function, computed in
        fewer matmuls. Names like `attention.wq` are gone afterwards: for lowering only."""
        for layer in self.layers:
            if layer.attention is not None:
                layer.attention.fuse(concat)
            layer.feed_forward.fuse(concat)

    def swap_rope_halves_by_matmul(self) -> None:
        """RoPE's half swap as a product with a constant +-1 matrix instead of two slices and a
        cat, for a backend that delegates no slice of a dynamic-length tensor (ExecuTorch's
        XNNPACK partitioner; upstream/xnnpack_dynamic_slice.py lets the pinned version). Not free:
        as the last matmul before the attention it slows custom_sdpa at 2 threads
        (docs/decisions/0027)."""
        self.rope_swap = half_swap_matrix(self.config.rope_dim)

    def use_cache_io(self) -> None:
        """Drop the KV-cache buffers for the cache-I/O form (`forward_cache_io`): there the runtime
        owns the cache, and unused buffers would still be exported, as constants of cache size."""
        for layer in self.layers:
            if layer.attention is not None:
                layer.attention.kv_cache = None

    def reset_buffers(self) -> None:
        """(Re)create RoPE tables and empty caches, e.g. after building on the meta device."""
        self._set_rope_tables()
        for layer in self.layers:
            if layer.conv is not None:
                cache = layer.conv.conv_cache
                cache.conv_cache = torch.zeros(cache.conv_cache.shape)
                continue
            cache = layer.attention.kv_cache
            if cache is None:  # the cache-I/O form
                continue
            cache.k_cache = torch.zeros(cache.k_cache.shape)
            cache.v_cache = torch.zeros(cache.v_cache.shape)

    def _set_rope_tables(self) -> None:
        """rope_cos/rope_sin, and rope_local_cos/rope_local_sin when some layers use the local base."""
        for kind in sorted({r for r in self.layer_rope if r is not None}):
            cos, sin = rope_tables(self.config, self.max_seq_len, local=kind == "local")
            prefix = "rope_local" if kind == "local" else "rope"
            self.register_buffer(f"{prefix}_cos", cos, persistent=False)
            self.register_buffer(f"{prefix}_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        return self.forward_embeddings(self.embed(tokens), input_pos, last_only)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        if (
            self.config.scale_embeddings
        ):  # sqrt(dim) rounded to float32, then to the embedding dtype, as transformers does
            h = h * torch.tensor(self.config.dim**0.5, dtype=torch.float32).to(h.dtype)
        if self.config.embedding_multiplier != 1.0:
            h = h * self.config.embedding_multiplier
        return h

    def forward_embeddings(
        self,
        h: torch.Tensor,
        input_pos: torch.Tensor,
        last_only: bool = False,
        image_tokens: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """image_tokens [1, T]: 1 where a row is an image's, whose rows then see each other both ways
        (image_block_masks; Gemma 3); None: causal. rope_positions [3, T]: M-RoPE's positions
        (mrope_section; Qwen2.5-VL); None: the cache positions."""
        return self.head(
            self.forward_blocks(h, input_pos, image_tokens=image_tokens, rope_positions=rope_positions), last_only
        )

    def forward_blocks(
        self,
        h: torch.Tensor,
        input_pos: torch.Tensor,
        first: int = 0,
        image_tokens: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h [1, T, dim] at positions input_pos[0] ... through blocks `first` to the last: the hidden
        states the head takes (size_budget.py resumes at a block to measure a change after it)."""
        seq_len = h.size(1)
        start = input_pos[0].item()
        torch._check(start >= 0)
        torch._check(start + seq_len <= self.max_seq_len)
        ropes = self._rope_at(start, seq_len) if rope_positions is None else self._rope_mrope(rope_positions)
        masks = (None, None)  # (full-attention layers', sliding-window layers'); None: causal from start
        window = self.config.sliding_window if any(self.layer_windowed) else None
        if image_tokens is not None:
            masks = image_block_masks(image_tokens, start, seq_len, self.max_seq_len, window, h.dtype)
        elif window is not None:
            masks = (None, sliding_window_mask(start, seq_len, self.max_seq_len, window, h.dtype))
        for layer, rope, windowed in zip(self.layers[first:], self.layer_rope[first:], self.layer_windowed[first:]):
            h = layer(h, start, ropes.get(rope), masks[windowed])  # rope None: no RoPE
        return h

    def forward_block(self, i: int, h: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Block i alone, on h [1, T, dim] at positions start ...: what forward_blocks computes there
        (quantize/streaming.py carries the hidden states from block to block, one block in memory)."""
        seq_len = h.size(1)
        mask = None
        if self.layer_windowed[i]:
            mask = sliding_window_mask(start, seq_len, self.max_seq_len, self.config.sliding_window, h.dtype)
        return self.layers[i](h, start, self._rope_at(start, seq_len).get(self.layer_rope[i]), mask)

    def forward_cache_io(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        window_mask: torch.Tensor | None,
        k_past: list,
        v_past: list,
        last_only: bool = True,
    ):
        """The cache-I/O form (see the module doc): tokens [1, T], positions [1, T] (each token's
        position), mask [1, 1, T, max_seq_len + T], window_mask the same for sliding-window layers
        (None without them), k_past / v_past one [1, n_kv_heads, max_seq_len, head_dim] per layer
        -> (logits, this call's k rows per layer, v rows per layer)."""
        h = self.embed(tokens)
        ropes = self._rope_gathered(positions)
        rows = [
            CacheRows(k, v, window_mask if windowed else mask)
            for k, v, windowed in zip(k_past, v_past, self.layer_windowed)
        ]
        for layer, rope, layer_rows in zip(self.layers, self.layer_rope, rows):
            h = layer(h, None, ropes.get(rope), None, layer_rows)
        return self.head(h, last_only), [r.k_new for r in rows], [r.v_new for r in rows]

    def head(self, h: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """The final norm and the LM head: hidden states [1, T, dim] -> logits [1, T, vocab]."""
        if last_only:  # only the next-token logits: skips the LM head for the other positions
            h = h[:, -1, :]
        h = self.norm(h)
        if self.head_rotation is not None:
            h = self.head_rotation(h)
        logits = self.output(h)
        if self.config.logit_divisor != 1.0:
            logits = logits / self.config.logit_divisor
        return self._softcap(logits)

    def _rope_at(self, start, seq_len: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The RoPE tables' rows for positions [start, start + seq_len), per kind in use."""
        # Shaped [1, S, 1, R] once here, not in every layer: every q and k broadcasts against them.
        return self._rope_rows(lambda table: table.narrow(0, start, seq_len)[None, :, None])

    def _rope_gathered(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The RoPE tables' rows at `positions` ([1, T]) as a gather: no position becomes a shape."""
        return self._rope_rows(lambda table: table[positions][:, :, None])  # [1, T, 1, R]

    def _rope_mrope(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """M-RoPE: each frequency's cos/sin at the position of its run (temporal, height, width),
        positions [3, T]; both halves of the rotate-half form follow the same runs."""
        runs = [axis for axis, n in enumerate(self.config.mrope_section) for _ in range(n)]
        axis = torch.tensor(runs + runs).view(1, 1, -1)  # [1, 1, R]

        def rows(table: torch.Tensor) -> torch.Tensor:
            gathered = table[positions]  # [3, T, R]
            return torch.gather(gathered, 0, axis.expand(1, gathered.size(1), -1))[:, :, None]  # [1, T, 1, R]

        return self._rope_rows(rows)

    def _rope_rows(self, rows) -> dict[str, tuple]:
        """`rows` of each kind's cos and sin tables, for the kinds in use, and the half swap."""
        return {
            kind: (rows(getattr(self, f"{prefix}_cos")), rows(getattr(self, f"{prefix}_sin")), self.rope_swap)
            for kind, prefix in (("global", "rope"), ("local", "rope_local"))
            if kind in self.layer_rope
        }

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
