"""rotation: an orthogonal change of basis of the decoder's residual stream, folded into the weights
before quantization (QuaRot / SpinQuant's R1), so that the linears reading the residual stream see
inputs without outlier channels and per-token int8 activations lose less.

The model computes the same function (up to float rounding): with Q orthogonal, the residual x
becomes x Q everywhere. An RMSNorm without weights commutes with Q (it keeps every vector's
length), so each norm's scale is first folded into the linears that read it; then the embedding
table becomes E Q, every linear reading the residual (wq, wk, wv, w1, w3) W Q and every linear
writing it (wo, w2) Q^T W.

The LM head reads the final norm's output x_hat * g. Untied, it becomes W diag(g) Q. Tied to the
embedding, it must keep reading the table E Q (one table in the program), so a d x d float linear
before it, `Decoder.head_rotation` = Q^T diag(g) Q, turns x_hat Q into (x_hat * g) Q, whose
product with (E Q)^T is the original logits. It stays float: at 8 bits it cost SmolLM2-135M more
than the rotation gave (docs/decisions/0017).

Sandwich norms (Gemma 2/3 and OLMo 2 normalise each block's attention and MLP outputs before the
residual add) cannot pass their scale to a linear: the norm's input comes from wo / w2, its output
goes to the residual stream. Around them: wo and w2 write y Q as every writer does (the norm, now
without its scale, keeps y Q's length, so it gives y_hat Q), and a d x d linear after it,
`Block.attention_post_rotation` / `ffn_post_rotation` = Q^T diag(g) Q, turns y_hat Q into
(y_hat * g) Q. Two d x d linears a block at run time: the price of rotating such a family.

Q is a randomized Hadamard matrix (random signs times H_{2^k} (x) a random orthogonal matrix of the
odd part of d), seeded: `genai eval` rebuilds the same quantized model from the float one.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from genai_pipeline.errors import InputError

SEED = 0


def random_hadamard(dim: int, seed: int = SEED) -> torch.Tensor:
    """An orthogonal [dim, dim] float64 matrix that spreads every coordinate over all of them."""
    g = torch.Generator().manual_seed(seed)
    power = dim & -dim  # the largest power of two dividing dim
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < power:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    odd, r = torch.linalg.qr(torch.randn(dim // power, dim // power, generator=g, dtype=torch.float64))
    odd = (odd * torch.sign(torch.diagonal(r))).contiguous()
    signs = torch.randint(0, 2, (dim,), generator=g).double() * 2 - 1
    return signs[:, None] * torch.kron(h / math.sqrt(power), odd)


def can_rotate(decoder: nn.Module) -> bool:
    """A text decoder of ours (models.decoder.Decoder): every norm layout rotates (see the module doc)."""
    return getattr(decoder, "config", None) is not None and hasattr(decoder, "layers")


@torch.no_grad()
def rotate(decoder: nn.Module, seed: int = SEED) -> None:
    """Rotate `decoder` (a models.decoder.Decoder) in place; see the module doc."""
    if not can_rotate(decoder):
        raise InputError("only a text decoder's residual stream can be rotated: quantize this model without rotation")
    q = random_hadamard(decoder.config.dim, seed)
    for block in decoder.layers:
        rotate_block(block, q)
    rotate_embedding(decoder, q)
    rotate_head(decoder, q)
    decoder.rotation_seed = seed


@torch.no_grad()
def rotate_block(block: nn.Module, q: torch.Tensor) -> None:
    """One block's part of `rotate`: its pre-norms' scales folded into their readers, W Q for the
    linears reading the residual stream, Q^T W for those writing it, and a post-norm's scale into
    the d x d linear after it."""
    scales = {}
    for norm, readers in block.norm_readers.items():
        g = _take_scale(getattr(block, norm))
        scales.update(dict.fromkeys(readers, g))
    for name in block.residual_readers:
        linear = block.get_submodule(name)
        w = linear.weight.double()
        _set(linear, (w if name not in scales else w * scales[name]) @ q)
    for linear in map(block.get_submodule, block.residual_writers):
        _set(linear, q.T @ linear.weight.double())
    dtype = block.get_submodule(block.residual_writers[0]).weight.dtype
    for norm, rotation in (("attention_post_norm", "attention_post_rotation"), ("ffn_post_norm", "ffn_post_rotation")):
        if not isinstance(getattr(block, norm), nn.Identity):
            setattr(block, rotation, _scaled_rotation(q, _take_scale(getattr(block, norm)), dtype))


@torch.no_grad()
def rotate_embedding(decoder: nn.Module, q: torch.Tensor) -> None:
    """The table E Q (a tied head reads it too)."""
    _times(decoder.tok_embeddings.weight, q)
    if decoder.config.tie_embeddings:
        decoder.tie_weights()


@torch.no_grad()
def rotate_head(decoder: nn.Module, q: torch.Tensor) -> None:
    """The final norm's scale folded into the head: W diag(g) Q untied; tied, the float
    head_rotation Q^T diag(g) Q before the rotated table (see the module doc)."""
    g = _take_scale(decoder.norm)
    if not decoder.config.tie_embeddings:
        decoder.output.weight.mul_(g.to(decoder.output.weight.dtype))
        _times(decoder.output.weight, q)
    else:
        decoder.head_rotation = _scaled_rotation(q, g, decoder.tok_embeddings.weight.dtype)


def _scaled_rotation(q: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> nn.Linear:
    """The d x d linear Q^T diag(g) Q: x_hat Q -> (x_hat * g) Q, after a norm whose scale g cannot
    move into a linear."""
    linear = nn.Linear(q.shape[0], q.shape[0], bias=False, dtype=dtype)
    _set(linear, q.T @ torch.diag(g) @ q)  # symmetric: its own transpose
    return linear


def _take_scale(norm) -> torch.Tensor:
    """A norm's scale (float64), the norm left without one."""
    g = norm.weight.double()
    norm.weight.fill_(0.0 if norm.unit_offset else 1.0)
    return 1 + g if norm.unit_offset else g


def _set(linear: nn.Linear, w: torch.Tensor) -> None:
    linear.weight.copy_(w.to(linear.weight.dtype))


def _times(w: torch.Tensor, q: torch.Tensor, rows: int = 16384) -> None:
    """w <- w Q in place, in float64 a block of rows at a time (a 128k-row table at once would take GBs)."""
    for i in range(0, w.shape[0], rows):
        w[i : i + rows] = (w[i : i + rows].double() @ q).to(w.dtype)


def unrotated(decoder: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`x`, a residual-stream tensor of `decoder` ([..., dim]), in the basis of the model before rotation."""
    if getattr(decoder, "rotation_seed", None) is None:
        return x
    return x @ random_hadamard(decoder.config.dim, decoder.rotation_seed).T.to(x.dtype)
