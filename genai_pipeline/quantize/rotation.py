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
    """A text decoder whose norms all sit before a linear: a sandwich norm (Gemma 2/3) normalises
    a block's output before the residual add, where no linear follows to take its scale."""
    config = getattr(decoder, "config", None)
    return config is not None and hasattr(decoder, "layers") and not config.sandwich_norms


@torch.no_grad()
def rotate(decoder: nn.Module, seed: int = SEED) -> None:
    """Rotate `decoder` (a models.decoder.Decoder) in place; see the module doc."""
    if not can_rotate(decoder):
        raise InputError("this decoder cannot be rotated (sandwich norms): quantize it without rotation")
    q = random_hadamard(decoder.config.dim, seed)
    for block in decoder.layers:
        rotate_block(block, q)
    rotate_embedding(decoder, q)
    rotate_head(decoder, q)
    decoder.rotation_seed = seed


@torch.no_grad()
def rotate_block(block: nn.Module, q: torch.Tensor) -> None:
    """One block's part of `rotate`: its norms' scales folded into their readers, W Q for the
    linears reading the residual stream, Q^T W for those writing it."""
    for norm, readers in block.norm_readers.items():
        g = _take_scale(getattr(block, norm))
        for linear in map(block.get_submodule, readers):
            _set(linear, linear.weight.double() * g @ q)
    for linear in map(block.get_submodule, block.residual_writers):
        _set(linear, q.T @ linear.weight.double())


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
        pre = nn.Linear(q.shape[0], q.shape[0], bias=False, dtype=decoder.tok_embeddings.weight.dtype)
        _set(pre, q.T @ torch.diag(g) @ q)  # symmetric: its own transpose
        decoder.head_rotation = pre


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
