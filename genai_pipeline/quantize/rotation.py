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

A decoder with sandwich norms (Gemma 2/3, OLMo 2) cannot rotate its residual stream: a norm after
a block's output takes no linear to fold its scale into, and folding the pre-norms' large scales
into their readers spreads their quantization noise over every channel (docs/decisions/0037).
`rotate_inputs` rotates the linears' inputs at run time instead (QuaRot's online rotations): each
pre-norm's output, wo's input and w2's input become x Q with Q = diag(signs) (I (x) H_64), the
signs folded into the op before (the norm's scale, wv's and w3's rows) and Q into the readers (W Q).
The residual stream stays as it is; a rotation is one float linear over the row viewed in runs of
64 (models/decoder.py hadamard_blocks). Runs of 64 lost less than runs of 32 or 128 on Gemma 3, and
cost a few percent of a decode step (docs/decisions/0040).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from genai_pipeline.errors import InputError

SEED = 0


@dataclass(frozen=True)
class Hadamard:
    """Q = diag(signs) (F_1 (x) F_2 (x) ... (x) F_k): orthogonal factors (the normalised Sylvester
    Hadamard matrix of the power of two in dim, split in factors of at most FACTOR rows, the last
    one (x) a random orthogonal matrix of dim's odd part). Applied factor by factor, a product with Q
    costs dim x (the factors' sizes) multiply-adds per row instead of dim x dim, and no dim x dim
    matrix is made (up to DENSE_UP_TO, one factor: Q itself)."""

    signs: torch.Tensor  # [dim], +-1, float64
    factors: tuple[torch.Tensor, ...]  # float64

    def right(self, x: torch.Tensor) -> torch.Tensor:
        """x Q over x's last dimension, in float64."""
        y = x.to(torch.float64, copy=True).mul_(self.signs)  # one float64 copy of x, not two
        shape, before, after = y.shape, y.numel() // y.shape[-1], y.shape[-1]
        for factor in self.factors:  # y as [before, this factor's axis, after]: F^T contracts the middle axis
            after //= factor.shape[0]
            y = y.reshape(-1, factor.shape[0]) @ factor if after == 1 else factor.T @ y.reshape(before, -1, after)
            before *= factor.shape[0]
        return y.reshape(shape)

    def left_transposed(self, w: torch.Tensor) -> torch.Tensor:
        """Q^T w, in float64 (w's rows indexed as Q's)."""
        return self.right(w.T).T

    def dense(self) -> torch.Tensor:
        return self.signs[:, None] * _kron(self.factors)


FACTOR = 64
DENSE_UP_TO = 1024  # a smaller Q is applied as one matrix: tiny factors cost more than they save


def hadamard(dim: int, seed: int = SEED) -> Hadamard:
    """The seeded Q of dim, as factors (random_hadamard: the same Q as one matrix). The odd part joins
    the last Sylvester factor: a factor of 3 or 5 alone makes products too thin to run fast."""
    g = torch.Generator().manual_seed(seed)
    power = dim & -dim  # the largest power of two dividing dim
    odd, r = torch.linalg.qr(torch.randn(dim // power, dim // power, generator=g, dtype=torch.float64))
    odd = (odd * torch.sign(torch.diagonal(r))).contiguous()
    signs = torch.randint(0, 2, (dim,), generator=g).double() * 2 - 1
    factors, left = [], power
    while left > 1:
        size = min(left, FACTOR)
        factors.append(_sylvester(size))
        left //= size
    factors = factors or [torch.ones(1, 1, dtype=torch.float64)]
    factors[-1] = torch.kron(factors[-1], odd)
    if dim <= DENSE_UP_TO:
        factors = [_kron(factors)]
    return Hadamard(signs, tuple(factors))


def _kron(factors) -> torch.Tensor:
    k = torch.ones(1, 1, dtype=torch.float64)
    for factor in factors:
        k = torch.kron(k, factor)
    return k


def _sylvester(n: int) -> torch.Tensor:
    """H_n / sqrt(n): H_2n = [[H_n, H_n], [H_n, -H_n]], so H_ab = H_a (x) H_b."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def random_hadamard(dim: int, seed: int = SEED) -> torch.Tensor:
    """An orthogonal [dim, dim] float64 matrix that spreads every coordinate over all of them."""
    return hadamard(dim, seed).dense()


INPUT_RUN = 64  # rotate_inputs: the Hadamard block, the runs of a row it mixes (docs/decisions/0040)


def _sandwich_norms(decoder: nn.Module) -> bool | None:
    """Whether a text decoder (models.decoder.Decoder) has sandwich norms; None: not one."""
    config = getattr(decoder, "config", None)
    return config.sandwich_norms if config is not None and hasattr(decoder, "layers") else None


def can_rotate(decoder: nn.Module) -> bool:
    """A text decoder whose norms all sit before a linear: a sandwich norm (Gemma 2/3) normalises
    a block's output before the residual add, where no linear follows to take its scale."""
    return _sandwich_norms(decoder) is False


@torch.no_grad()
def rotate(decoder: nn.Module, seed: int = SEED, writers: tuple[nn.Linear, ...] = ()) -> None:
    """Rotate `decoder` (a models.decoder.Decoder) in place; see the module doc. `writers`: linears
    outside the decoder whose outputs enter its residual stream (a vision-language model's
    connector), Q^T W too."""
    if not can_rotate(decoder):
        raise InputError("this decoder cannot be rotated (sandwich norms): quantize it without rotation")
    q = hadamard(decoder.config.dim, seed)
    for block in decoder.layers:
        rotate_block(block, q)
    for linear in writers:
        rotate_writer(linear, q)
    rotate_embedding(decoder, q)
    rotate_head(decoder, q)
    decoder.rotation_seed = seed


@torch.no_grad()
def rotate_block(block: nn.Module, q: Hadamard) -> None:
    """One block's part of `rotate`: its norms' scales folded into their readers, W Q for the
    linears reading the residual stream, Q^T W for those writing it."""
    for norm, readers in block.norm_readers.items():
        g = _take_scale(getattr(block, norm))
        for linear in map(block.get_submodule, readers):
            _set(linear, q.right(linear.weight.double() * g))
    for linear in map(block.get_submodule, block.residual_writers):
        rotate_writer(linear, q)


@torch.no_grad()
def rotate_writer(linear: nn.Linear, q: Hadamard) -> None:
    """A linear writing the residual stream: its output y becomes y Q (Q^T W, and b Q)."""
    _set(linear, q.left_transposed(linear.weight))
    if linear.bias is not None:
        linear.bias.copy_(q.right(linear.bias).to(linear.bias.dtype))


def rotates_inputs(decoder: nn.Module) -> bool:
    """A text decoder whose residual stream cannot be rotated (sandwich norms): its linears'
    inputs are, at run time (rotate_inputs)."""
    return _sandwich_norms(decoder) is True


@torch.no_grad()
def rotate_inputs(block: nn.Module, seed: int = SEED) -> None:
    """Rotate the inputs of `block`'s linears at run time (see the module doc): the same function,
    up to float rounding."""
    for norm, readers in block.norm_readers.items():
        norm = getattr(block, norm)
        signs = _signs(norm.weight.shape[0], seed)
        if norm.unit_offset:  # x * (1 + w)
            norm.weight.copy_(((1 + norm.weight.double()) * signs - 1).to(norm.weight.dtype))
        else:
            norm.weight.mul_(signs.to(norm.weight.dtype))
        norm.rotation = _rotate_readers(map(block.get_submodule, readers), signs)
    attention = block.attention
    if attention is not None:  # wo's input channel (head h, d) is v's (kv head of h, d): one sign for both
        signs = _signs(attention.n_kv_heads * attention.head_dim, seed)
        _flip_rows(attention.wv, signs)
        repeat = attention.n_heads // attention.n_kv_heads
        signs = signs.view(attention.n_kv_heads, 1, -1).expand(-1, repeat, -1).reshape(-1)
        attention.wo_rotation = _rotate_readers([attention.wo], signs)
    mlp = block.feed_forward
    signs = _signs(mlp.w2.weight.shape[1], seed)
    _flip_rows(mlp.w3, signs)  # w2 reads act(w1 x) * w3 x
    mlp.w2_rotation = _rotate_readers([mlp.w2], signs)


def _signs(width: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2, (width,), generator=torch.Generator().manual_seed(seed)).double() * 2 - 1


def _flip_rows(linear: nn.Linear, signs: torch.Tensor) -> None:
    linear.weight.mul_(signs[:, None].to(linear.weight.dtype))
    if linear.bias is not None:
        linear.bias.mul_(signs.to(linear.bias.dtype))


def _rotate_readers(readers, signs: torch.Tensor) -> torch.Tensor:
    """W diag(signs) (I (x) H) for each reader, in place; H, the float product the input takes first."""
    h = _sylvester(min(INPUT_RUN, signs.shape[0] & -signs.shape[0]))
    for linear in readers:
        w = linear.weight.double() * signs
        _set(linear, (w.reshape(w.shape[0], -1, h.shape[0]) @ h).reshape(w.shape))
    # a tensor of its own at every site (a plain tensor shared by all of them failed to lower); XNNPACK
    # stores equal bytes once, so the program holds one copy
    return h.to(torch.float32)


@torch.no_grad()
def rotate_embedding(decoder: nn.Module, q: Hadamard) -> None:
    """The table E Q (a tied head reads it too)."""
    _times(decoder.tok_embeddings.weight, q)
    if decoder.config.tie_embeddings:
        decoder.tie_weights()


@torch.no_grad()
def rotate_head(decoder: nn.Module, q: Hadamard) -> None:
    """The final norm's scale folded into the head: W diag(g) Q untied; tied, the float
    head_rotation Q^T diag(g) Q before the rotated table (see the module doc)."""
    g = _take_scale(decoder.norm)
    if not decoder.config.tie_embeddings:
        decoder.output.weight.mul_(g.to(decoder.output.weight.dtype))
        _times(decoder.output.weight, q)
    else:
        pre = nn.Linear(g.shape[0], g.shape[0], bias=False, dtype=decoder.tok_embeddings.weight.dtype)
        _set(pre, q.left_transposed(q.right(torch.diag(g))))  # Q^T diag(g) Q, symmetric: its own transpose
        decoder.head_rotation = pre


def _take_scale(norm) -> torch.Tensor:
    """A norm's scale (float64), the norm left without one."""
    g = norm.weight.double()
    norm.weight.fill_(0.0 if norm.unit_offset else 1.0)
    return 1 + g if norm.unit_offset else g


def _set(linear: nn.Linear, w: torch.Tensor) -> None:
    linear.weight.copy_(w.to(linear.weight.dtype))


def _times(w: torch.Tensor, q: Hadamard, rows: int = 16384) -> None:
    """w <- w Q in place, in float64 a block of rows at a time (a 128k-row table at once would take GBs)."""
    for i in range(0, w.shape[0], rows):
        w[i : i + rows] = q.right(w[i : i + rows]).to(w.dtype)


def unrotated(decoder: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`x`, a residual-stream tensor of `decoder` ([..., dim]), in the basis of the model before rotation."""
    if getattr(decoder, "rotation_seed", None) is None:
        return x
    return x @ random_hadamard(decoder.config.dim, decoder.rotation_seed).T.to(x.dtype)
