"""quantize, weight values: torchao configs, int4 values and scales by rule (q4_0, mse, torchao,
weighted mse), given int4 weights (a GGUF's) as XNNPACK runs them, and their file beside a program."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from genai_pipeline.artifacts import PreparedModel
from genai_pipeline.errors import InputError
from genai_pipeline.options import QuantOptions

log = logging.getLogger(__name__)


def linear_config(recipe: str, group_size: int):
    """torchao's config for a linear layer in `recipe` (8da4w, 8da8w); bench/gemv.py measures its kernels."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    if recipe == "8da4w":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))


def linear_bytes(out_features: int, in_features: int, recipe: str, group_size: int) -> int:
    """A linear weight's bytes in an XNNPACK program: int4 values two to a byte and one bf16 scale
    per group (8da4w), int8 values and one fp32 scale per row (8da8w), or fp32."""
    n = out_features * in_features
    return {"8da4w": n // 2 + n // group_size * 2, "8da8w": n + out_features * 4, "fp32": n * 4}[recipe]


def embedding_config(recipe: str, group_size: int):
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    if recipe == "4w":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))


def intx_weight(
    qdata: torch.Tensor, scale: torch.Tensor, bits: int, dtype: torch.dtype = torch.float32, dynamic: bool = True
):
    """torchao's quantized weight for a linear layer (what `Int8DynamicActivationIntxWeightConfig`
    makes: dynamic int8 per-token activations, symmetric int`bits` weights) from GIVEN integers
    `qdata` ([out, in], int8 values in the int`bits` range) and scales ([out, in // group]; one
    column: per channel). The exported program carries exactly these integers and scales
    (XNNPACK stores group-wise scales as bf16: give bf16-representable ones to keep them exact)."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if qdata.dim() != 2 or scale.dim() != 2 or scale.shape[0] != qdata.shape[0] or qdata.shape[1] % scale.shape[1]:
        raise InputError(f"weight integers {tuple(qdata.shape)} and scales {tuple(scale.shape)} do not match")
    if qdata.numel() and (int(qdata.min()) < qmin or int(qdata.max()) > qmax):
        raise InputError(f"weight integers outside the int{bits} range [{qmin}, {qmax}]")
    if not torch.isfinite(scale).all():
        raise InputError("weight scales must be finite")
    qdata = qdata.to(torch.int8).contiguous()
    scale = scale.to(dtype).contiguous()
    return IntxUnpackedToInt8Tensor(
        qdata,
        scale,
        torch.zeros(scale.shape, dtype=torch.int8),
        getattr(torch, f"int{bits}"),
        (1, qdata.shape[1] // scale.shape[1]),
        dtype,
        "int8_asym_per_token" if dynamic else None,
    )


def concat_rows(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The rows of `weights` as one weight when they are all float of one dtype, or all torchao
    int weights of one format (bits, groups, activation quantization); else None."""
    first = weights[0]
    if any(type(w) is not type(first) or w.dtype != first.dtype for w in weights):
        return None
    if type(first).__name__ != "IntxUnpackedToInt8Tensor":
        return (
            torch.cat([w.detach() for w in weights])
            if all(type(w) in (torch.Tensor, nn.Parameter) for w in weights)
            else None
        )
    same = lambda w: (w.target_dtype, tuple(w.block_size), w.activation_quantization)  # noqa: E731
    if any(same(w) != same(first) for w in weights):
        return None
    return type(first)(
        *(torch.cat([getattr(w, f) for w in weights]) for f in ("qdata", "scale", "zero_point")),
        first.target_dtype,
        first.block_size,
        first.dtype,
        first.activation_quantization,
    )


def groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    return w.detach().float().reshape(w.shape[0], w.shape[1] // group_size, group_size)


def _round_scale(d: torch.Tensor, bf16: bool = True) -> torch.Tensor:
    """Scales as the program stores them (XNNPACK: bf16 for group-wise int4), never zero."""
    tiny = torch.finfo(torch.bfloat16).tiny * 4
    d = torch.where(d.abs() < tiny, torch.full_like(d, tiny), d)
    return d.to(torch.bfloat16).float() if bf16 else d


def q4_0_qparams(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_0 rule per group as XNNPACK can run it. llama.cpp takes d = (the signed
    value of largest magnitude) / -8, so that value maps to -8; d < 0 when it is positive, and
    XNNPACK refuses negative scales (tested), so then the value maps to +7 (d = max / 7)."""
    g = groups(w, group_size)
    m = g.gather(-1, g.abs().argmax(-1, keepdim=True))
    d = _round_scale(torch.where(m < 0, -m / 8, m / 7))
    q = torch.clamp(torch.round(g / d), -8, 7)
    return q.reshape(w.shape).to(torch.int8), d.squeeze(-1)


def mse_qparams(w: torch.Tensor, group_size: int, bits: int = 4, divisors=None, rows: int = 4096, bf16: bool = True):
    """Per group, the scale absmax / c (c over a small grid, scales rounded as stored) whose
    round-to-nearest weights are closest to the float ones (least squared error). Symmetric, so
    XNNPACK runs it; the grid spans torchao's absmax / 7.5 and both ends of llama.cpp's Q4_0
    (the extreme value at -8 or at +7)."""
    qmax = (1 << (bits - 1)) - 1
    if divisors is None:
        divisors = torch.linspace(qmax - 1.5, qmax + 1.5, 31).tolist()
    qs, ds = [], []
    for part in groups(w, group_size).split(rows):
        amax = part.abs().amax(-1, keepdim=True)
        best_err, best_d = None, None
        for c in divisors:
            d = _round_scale(amax / c, bf16)
            err = (torch.clamp(torch.round(part / d), -qmax - 1, qmax) * d - part).pow(2).sum(-1, keepdim=True)
            if best_err is None:
                best_err, best_d = err, d
            else:
                better = err < best_err
                best_err, best_d = torch.where(better, err, best_err), torch.where(better, d, best_d)
        qs.append(torch.clamp(torch.round(part / best_d), -qmax - 1, qmax).to(torch.int8))
        ds.append(best_d.squeeze(-1))
    return torch.cat(qs).reshape(w.shape), torch.cat(ds)


def torchao_qparams(w: torch.Tensor, group_size: int, bits: int = 4, bf16: bool = True):
    """torchao's symmetric rule (absmax / (qmax + 0.5), values clamped to [-2^(b-1), 2^(b-1) - 1])."""
    qmax = (1 << (bits - 1)) - 1
    g = groups(w, group_size)
    d = _round_scale(g.abs().amax(-1, keepdim=True) / (qmax + 0.5), bf16)
    q = torch.clamp(torch.round(g / d), -qmax - 1, qmax)
    return q.reshape(w.shape).to(torch.int8), d.squeeze(-1)


def wmse_qparams(w: torch.Tensor, group_size: int, importance: torch.Tensor, bits: int = 4, elements: int = 1 << 20):
    """mse_qparams with each input column's squared error weighted by `importance` [in] (the mean
    squared activation it meets: llama.cpp's importance matrix). Every candidate scale is weighed at
    once, for a band of rows at a time (at most `elements` values of all candidates together: a
    128k-row head at once would take GBs)."""
    qmax = (1 << (bits - 1)) - 1
    divisors = torch.linspace(qmax - 1.5, qmax + 1.5, 31)[:, None, None, None]
    iw = importance.float().reshape(1, -1, group_size)
    rows = max(1, elements // (len(divisors) * w.shape[1]))
    qs, ds = [], []
    for g in groups(w, group_size).split(rows):
        d = _round_scale(g.abs().amax(-1, keepdim=True) / divisors)  # [candidates, rows, groups, 1]
        err = torch.div(g, d).round_().clamp_(-qmax - 1, qmax).mul_(d).sub_(g).square_().mul_(iw).sum(-1)
        best_d = d.squeeze(-1).gather(0, err.argmin(0, keepdim=True))[0, ..., None]  # the first of equal errors
        qs.append(torch.clamp(torch.round(g / best_d), -qmax - 1, qmax).to(torch.int8))
        ds.append(best_d.squeeze(-1))
    return torch.cat(qs).reshape(w.shape), torch.cat(ds)


def packed_int4(given: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """int4 values [out, in] in [-8, 7] and their scales, two values a byte and bf16 scales (as
    XNNPACK stores them): what the QDQ cache keeps (qdq_cache.py)."""
    packed = {}
    for name, (q, d) in given.items():
        u = (q.to(torch.int16) + 8).to(torch.uint8).reshape(-1)
        packed[name] = {"shape": tuple(q.shape), "nibbles": u[1::2] << 4 | u[::2], "scale": d.to(torch.bfloat16)}
    return packed


def unpacked_int4(packed: Mapping[str, dict], consume: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The inverse of packed_int4; `consume` (a dict): each packed entry dropped once unpacked, so
    the two forms of a whole model (a 3B one's 2.5 + 1.3 GB) are not held at once. Each tensor's
    values are written into their int8 tensor in place (a head's 394 M values: no int16 copy)."""
    out = {}
    for name in list(packed):
        p = packed.pop(name) if consume else packed[name]
        values = torch.empty(2 * p["nibbles"].numel(), dtype=torch.int8)
        values[0::2] = p["nibbles"] & 15
        values[1::2] = p["nibbles"] >> 4
        out[name] = values.sub_(8).reshape(p["shape"]), p["scale"].float()
    return out


def load_int4(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The int4 weights an export of an earlier version kept in its folder (`<artifact>.int4.pt`)."""
    return unpacked_int4(torch.load(path, weights_only=True))


RULES = {
    "mse": mse_qparams,
    "q4_0": q4_0_qparams,
    "torchao": torchao_qparams,
    "gptq": mse_qparams,
}  # gptq: without calibration


def given_qparams(
    name: str, q: torch.Tensor, d: torch.Tensor, shape: torch.Size, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Given int4 values and group scales (e.g. a GGUF's Q4_0 blocks) as XNNPACK can run them:
    a block with a negative scale (llama.cpp's d < 0) is negated; its -8s would become +8, out of
    range, and are clamped to +7 (logged: the only values this path changes)."""
    q, d = q.to(torch.int8), d.float()
    if tuple(q.shape) != tuple(shape) or d.dim() != 2 or d.shape[0] != shape[0] or shape[1] != d.shape[1] * group:
        raise InputError(
            f"given weight of {name}: integers {tuple(q.shape)} and scales {tuple(d.shape)} "
            f"do not match the layer's {tuple(shape)} in groups of {group} (--group-size)"
        )
    if int(q.min()) < -8 or int(q.max()) > 7:
        raise InputError(f"given weight of {name}: integers outside [-8, 7]")
    negative = (d < 0).repeat_interleave(group, dim=1)
    if negative.any():
        clamped = int((negative & (q == -8)).sum())
        q = torch.where(negative, -q.to(torch.int16), q.to(torch.int16)).clamp(-8, 7).to(torch.int8)
        d = d.abs()
        if clamped:
            log.warning(
                "%s: %d of %d given int4 values are -8 under a negative scale; stored as +7 of the "
                "negated scale (XNNPACK takes positive scales only)",
                name,
                clamped,
                q.numel(),
            )
    return q, d


def checkpoint_int4(prepared: PreparedModel, options: QuantOptions) -> dict | None:
    """A GGUF checkpoint's Q4_0 tensors where the recipe's grid is the file's (8da4w, group 32:
    symmetric int4, one scale per 32 weights): the program then holds the integers and scales
    llama.cpp runs, not a re-quantization of their dequantized values."""
    from genai_pipeline.checkpoints import gguf, gguf_q4_0

    if options.recipe != "8da4w" or options.group_size != 32 or prepared.weights == "random":
        return None
    file = gguf.gguf_file(Path(prepared.weights))
    if file is None:
        return None
    q4_0 = gguf_q4_0.read_q4_0(file)
    if prepared.config.tie_embeddings and "tok_embeddings.weight" in q4_0:
        q4_0["output.weight"] = q4_0["tok_embeddings.weight"]  # llama.cpp stores a tied head once, as token_embd
    linears = {
        f"{n}.weight"
        for n, m in next(iter(prepared.artifacts.values())).module.named_modules()
        if isinstance(m, nn.Linear)
    }
    q4_0 = {name: values for name, values in q4_0.items() if name in linears}
    if q4_0:
        log.info("taking %d Q4_0 tensors of %s as they are", len(q4_0), file.name)
    return q4_0 or None
