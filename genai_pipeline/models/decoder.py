"""The one export-friendly decoder: every Llama-family model is this file plus a DecoderConfig.

Read top to bottom: config, RoPE, KV cache, attention, MLP, block, decoder.

Export notes (why it looks the way it does):
- Positions come in explicitly (`input_pos`, shape [1]: the position of the first token); no
  Python control flow depends on data, so one trace serves every call.
- The KV cache is a pair of buffers per layer in ExecuTorch's `[B, S, H, D]` layout, written by
  `llama.update_cache` and read by `llama.custom_sdpa`; a plain `index_copy_` cache lowers to a
  whole-cache copy per call. Attention is causal from `start`, so padding after the last real
  token of a chunk never changes a real token's output, and the next write overwrites it.
- RoPE uses the Hugging Face "rotate half" convention, so HF checkpoints load without permuting
  q/k weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  registers torch.ops.llama.*


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling of RoPE (`rope_type: llama3` in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    tie_embeddings: bool = False
    max_position_embeddings: int = 2048

    def __post_init__(self):
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim"):
            if getattr(self, field) <= 0:
                raise ValueError(f"DecoderConfig.{field} must be positive, got {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ValueError(f"dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_params(self) -> int:
        d, hd = self.dim, self.head_dim
        attn = d * hd * (self.n_heads * 2 + self.n_kv_heads * 2)
        if self.qkv_bias:
            attn += hd * (self.n_heads + 2 * self.n_kv_heads)
        if self.qk_norm:
            attn += 2 * hd
        block = attn + 3 * d * self.hidden_dim + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.n_layers * block + d + head


def rope_inverse_frequencies(config: DecoderConfig) -> torch.Tensor:
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend in between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_tables(config: DecoderConfig, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [max_seq_len, head_dim], halves repeated as in HF's `rotate_half` form."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), rope_inverse_frequencies(config))
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, D]; cos, sin: [S, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class KVCache(nn.Module):
    """Static cache, [1, max_seq_len, n_kv_heads, head_dim]; a mutable buffer in the program."""

    def __init__(self, max_seq_len: int, n_kv_heads: int, head_dim: int):
        super().__init__()
        shape = (1, max_seq_len, n_kv_heads, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        torch.ops.llama.update_cache(k, self.k_cache, start)
        torch.ops.llama.update_cache(v, self.v_cache, start)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, max_seq_len: int):
        super().__init__()
        c, hd = config, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, hd
        self.wq = nn.Linear(c.dim, c.n_heads * hd, bias=c.qkv_bias)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * hd, bias=c.qkv_bias)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * hd, bias=c.qkv_bias)
        self.wo = nn.Linear(c.n_heads * hd, c.dim, bias=False)
        self.q_norm = RMSNorm(hd, c.norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(hd, c.norm_eps) if c.qk_norm else None
        self.kv_cache = KVCache(max_seq_len, c.n_kv_heads, hd)

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.kv_cache.update(k, v, start)
        # Causal from `start`: token i attends to cache positions [0, start + i]. GQA is native.
        y = torch.ops.llama.custom_sdpa(q, self.kv_cache.k_cache, self.kv_cache.v_cache, start, None, 0.0, True)
        return self.wo(y.reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: DecoderConfig, max_seq_len: int):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, max_seq_len)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), start, cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Decoder(nn.Module):
    """tokens [1, T] + input_pos [1] -> logits [1, T, vocab] (or [1, vocab] with last_only).

    `forward_embeddings` takes embeddings instead of ids: the multimodal path splices image
    embeddings in front of text embeddings and reuses this same decoder.
    """

    def __init__(self, config: DecoderConfig, max_seq_len: int):
        super().__init__()
        self.config, self.max_seq_len = config, max_seq_len
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, max_seq_len) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rope_tables(config, max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def reset_buffers(self) -> None:
        """(Re)create RoPE tables and empty caches, e.g. after building on the meta device."""
        cos, sin = rope_tables(self.config, self.max_seq_len)
        self.rope_cos, self.rope_sin = cos, sin
        for layer in self.layers:
            cache = layer.attention.kv_cache
            cache.k_cache = torch.zeros(cache.k_cache.shape)
            cache.v_cache = torch.zeros(cache.v_cache.shape)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        return self.forward_embeddings(self.tok_embeddings(tokens), input_pos, last_only)

    def forward_embeddings(self, h: torch.Tensor, input_pos: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        seq_len = h.size(1)
        start = input_pos[0].item()
        torch._check(start >= 0)
        torch._check(start + seq_len <= self.max_seq_len)
        cos = self.rope_cos.narrow(0, start, seq_len)
        sin = self.rope_sin.narrow(0, start, seq_len)
        for layer in self.layers:
            h = layer(h, start, cos, sin)
        if last_only:  # only the next-token logits: skips the LM head for the other positions
            return self.output(self.norm(h[:, -1, :]))
        return self.output(self.norm(h))
