"""quantize: post-training quantization of an artifact's weights, before its graphs are exported.

Every graph of an artifact wraps the same eager module (see prepare.DecoderGraph), so quantizing
that module once gives `prefill` and `decode` bit-identical quantized weights, which the
backend then stores once. Recipes are torchao configs applied in eager mode:

- `8da4w`: dynamic per-token int8 activations, int4 group-wise weights (`group_size`). Weights by
  `weight_rule`: `gptq` (default; calibrated on --calib's text, else DEFAULT_GPTQ_TEXT), `mse` (a
  least-squares scale search per group, no data), `q4_0` (llama.cpp's rule with positive scales),
  `torchao` (absmax / 7.5, the rule before). The attention's value projection (AUTO_8BIT) and the
  MLP's down projection in llama.cpp's `use_more_bits` layers (more_bits_layer) stay at 8 bits, and
  the LM head too unless GPTQ quantizes it (AUTO_HEAD). Scales are chosen as XNNPACK stores them:
  positive, bf16. With a size budget (`--size-budget MB`) size_budget.py chooses the 8-bit layers
  by measurement instead of those rules.
  `given` int4 weights (a GGUF's) are taken as they are (`intx_weight`).
- `8da8w`: dynamic per-token int8 activations, int8 per-channel weights
- Both dynamic recipes first rotate the residual stream of the float model (rotation.py: an
  orthogonal change of basis folded into the weights; a tied head gains a float d x d linear before
  it), then smooth it (`smooth`, SmoothQuant at SMOOTH_ALPHA on the
  same calibration text as gptq): per-channel factors move activation outliers into the weights
  where a float op before the linear can absorb them; the graph is unchanged. Under 8da4w, w1 / w3
  of the first and last EDGE_LAYERS of the blocks stay at 8 bits too.
- embedding `8w` / `4w`: weight-only int8 per-row / int4 group-wise token embedding. By default
  (`auto`) it follows the linear recipe: `8da4w` -> `4w`, `8da8w` -> `8w`. A tied LM head is
  quantized as a linear layer either way, so an fp32 embedding would be the largest tensor left
  (SmolLM2-135M: 113 of 181 MB); `fp32` keeps it anyway.

Static recipes (`8a8w` on xnnpack; `16a8w`, `16a4w`, `16a4w_block`, `8a8w` on qnn) calibrate
activation ranges on data, with the target's PT2E quantizer, on the artifact's *quantize graph*
(dynamic length, every position). The calibrated QDQ model is then exported once per deploy
graph (prefill, decode, forward), so every graph carries the very same scales and zero points
for every weight and activation: the encodings propagate by construction.

Per-layer overrides map a regex over linear-layer names to a recipe (first match wins), e.g.
`output=8da8w` keeps the LM head at 8 bits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from genai_pipeline.artifacts import Artifact, GraphBundle, PreparedModel
from genai_pipeline.bundle import tool_versions
from genai_pipeline.chat_template import read_chat_template
from genai_pipeline.data import calibration_steps, iterate_with_progress
from genai_pipeline.errors import InputError
from genai_pipeline.options import EDGE_LAYERS, SMOOTH_ALPHA, CalibrationOptions, QuantOptions
from genai_pipeline.rotation import can_rotate, rotate

log = logging.getLogger(__name__)

# gptq's calibration text when no --calib is given: English prose that ships with the repository
# (Python's documentation, the reference model's training split; disjoint from heldout.txt)
DEFAULT_GPTQ_TEXT = Path(__file__).resolve().parent.parent / "assets" / "reference" / "sample.txt"
GPTQ_TOKENS = 4096  # calibration tokens for gptq (docs/decisions/0011)
HEAD = "output"
HEAD_ROTATION = "head_rotation"


def linear_config(recipe: str, group_size: int):
    """torchao's config for a linear layer in `recipe` (8da4w, 8da8w); bench/gemv.py measures its kernels."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    if recipe == "8da4w":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))


def _embedding_config(recipe: str, group_size: int):
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    if recipe == "4w":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))


def intx_weight(qdata: torch.Tensor, scale: torch.Tensor, bits: int, dtype: torch.dtype = torch.float32, dynamic: bool = True):
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
        qdata, scale, torch.zeros(scale.shape, dtype=torch.int8), getattr(torch, f"int{bits}"),
        (1, qdata.shape[1] // scale.shape[1]), dtype, "int8_asym_per_token" if dynamic else None,
    )


def concat_rows(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The rows of `weights` as one weight when they are all float of one dtype, or all torchao
    int weights of one format (bits, groups, activation quantization); else None."""
    first = weights[0]
    if any(type(w) is not type(first) or w.dtype != first.dtype for w in weights):
        return None
    if type(first).__name__ != "IntxUnpackedToInt8Tensor":
        return torch.cat([w.detach() for w in weights]) if all(type(w) in (torch.Tensor, nn.Parameter) for w in weights) else None
    same = lambda w: (w.target_dtype, tuple(w.block_size), w.activation_quantization)  # noqa: E731
    if any(same(w) != same(first) for w in weights):
        return None
    return type(first)(*(torch.cat([getattr(w, f) for w in weights]) for f in ("qdata", "scale", "zero_point")),
                       first.target_dtype, first.block_size, first.dtype, first.activation_quantization)


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
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
    g = _groups(w, group_size)
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
    for part in _groups(w, group_size).split(rows):
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
    g = _groups(w, group_size)
    d = _round_scale(g.abs().amax(-1, keepdim=True) / (qmax + 0.5), bf16)
    q = torch.clamp(torch.round(g / d), -qmax - 1, qmax)
    return q.reshape(w.shape).to(torch.int8), d.squeeze(-1)


def more_bits_layer(i: int, n_layers: int) -> bool:
    """llama.cpp's `use_more_bits` (the layers whose ffn_down and attn_v Q4_K_M stores at 6 bits):
    the first and last eighth of the blocks, and every third block between them."""
    return i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2


def auto_8bit_mlp(name: str, recipe: str, n_layers: int) -> bool:
    """Whether `name`, an MLP projection of block i of n_layers, stays at 8 bits under `recipe`: w2
    where more_bits_layer(i), w1 and w3 in the first and last EDGE_LAYERS[recipe] of the blocks."""
    match = re.fullmatch(r"layers\.(\d+)\.feed_forward\.(w[123])", name)
    if recipe not in EDGE_LAYERS or not match:
        return False
    i, k = int(match[1]), int(n_layers * EDGE_LAYERS[recipe])
    return more_bits_layer(i, n_layers) if match[2] == "w2" else i < k or i >= n_layers - k


def recipe_for(name: str, options: QuantOptions, n_layers: int) -> str:
    """The recipe of linear layer `name` in a model of n_layers blocks (first matching override wins)."""
    default = options.head if name == HEAD and options.head else options.recipe
    if name == HEAD_ROTATION:  # rotation's float linear before a tied head (rotation.py)
        default = "fp32"
    if options.recipe == "8da4w" and (any(re.search(p, name) for p in options.keep_8bit) or name in (options.promoted or ())
                                      or options.size_budget is None and auto_8bit_mlp(name, options.recipe, n_layers)):
        default = "8da8w"
    return next((r for pattern, r in options.overrides if re.search(pattern, name)), default)


def linear_recipes(module: nn.Module, options: QuantOptions) -> dict[str, str]:
    """name -> recipe_for(name) of every linear in `module`."""
    n_layers = len(getattr(module, "layers", ()))
    return {n: recipe_for(n, options, n_layers) for n, m in module.named_modules() if isinstance(m, nn.Linear)}


def wmse_qparams(w: torch.Tensor, group_size: int, importance: torch.Tensor, bits: int = 4):
    """mse_qparams with each input column's squared error weighted by `importance` [in] (the mean
    squared activation it meets: llama.cpp's importance matrix)."""
    qmax = (1 << (bits - 1)) - 1
    g, iw = _groups(w, group_size), importance.float().reshape(1, -1, group_size)
    amax, best, best_d = g.abs().amax(-1, keepdim=True), None, None
    for c in torch.linspace(qmax - 1.5, qmax + 1.5, 31).tolist():
        d = _round_scale(amax / c)
        err = ((torch.clamp(torch.round(g / d), -qmax - 1, qmax) * d - g).pow(2) * iw).sum(-1, keepdim=True)
        best, best_d = (err, d) if best is None else (torch.minimum(err, best), torch.where(err < best, d, best_d))
    return torch.clamp(torch.round(g / best_d), -qmax - 1, qmax).reshape(w.shape).to(torch.int8), best_d.squeeze(-1)


@torch.no_grad()
def gptq_qparams(w: torch.Tensor, hessian: torch.Tensor, group_size: int, block: int = 128, damp: float = 0.01):
    """GPTQ (Frantar et al. 2022) on a symmetric int4 grid: columns are rounded in order and each
    one's error is spread over the columns not yet rounded through the Cholesky factor of the
    inverse Hessian (X^T X of the layer's inputs); a group's scale is chosen (importance-weighted
    mse) when its first column comes up, from the weights as updated so far."""
    W, H = w.detach().float().clone(), hessian.detach().float().clone()
    n = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += damp * torch.diag(H).mean() * torch.eye(n)
    importance = torch.diag(H).clone()
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q, D = torch.zeros_like(W, dtype=torch.int8), torch.zeros(W.shape[0], n // group_size)
    block = max(group_size, block // group_size * group_size)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        W1, E1, Hi = W[:, i1:i2].clone(), torch.zeros(W.shape[0], i2 - i1), Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            if (i1 + i) % group_size == 0:
                d = wmse_qparams(W1[:, i : i + group_size], group_size, importance[i1 + i : i1 + i + group_size])[1][:, 0]
                D[:, (i1 + i) // group_size] = d
            q = torch.clamp(torch.round(W1[:, i] / d), -8, 7)
            Q[:, i1 + i] = q.to(torch.int8)
            E1[:, i] = (W1[:, i] - q * d) / Hi[i, i]
            W1[:, i:] -= E1[:, i : i + 1] * Hi[i, i:][None, :]
        W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
    return Q, D


@torch.no_grad()
def observe_inputs(module: nn.Module, names: set[str], samples: list[list[int]], window: int,
                   record: Callable[[str, torch.Tensor], None]) -> None:
    """Run `samples` (token lists) through `module` from position 0 in windows, calling
    record(name, x) with each named layer's input as float rows, [tokens, in_features]."""

    def hook(name):
        return lambda _, inputs, __: record(name, inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float())

    handles = [m.register_forward_hook(hook(n)) for n, m in module.named_modules() if n in names]
    try:
        for sample in samples:
            for i in range(0, len(sample), window):
                module(torch.tensor([sample[i : i + window]]), torch.tensor([0]))
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def input_hessians(module: nn.Module, names: set[str], samples: list[list[int]], window: int) -> tuple[dict, dict]:
    """X^T X of each named linear's inputs over `samples` (token lists, run from position 0 in
    windows), and which layers read the same input (shared_inputs)."""
    hessians = input_statistics(module, samples, window, names)[1]
    return hessians, shared_inputs(hessians)


def shared_inputs(hessians: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Which layers of one parent read the same input (q, k, v; w1, w3), from their X^T X:
    bit-identical sums over the same tensors (a tensor's address is no test: the allocator reuses
    memory). {name: the names of its group}."""
    shared = {}
    for name in sorted(hessians):
        parent = name.rpartition(".")[0]
        twin = next((n for n in shared if n.rpartition(".")[0] == parent
                     and torch.equal(hessians[n], hessians[name])), None)
        if twin is None:
            shared[name] = [name]
        else:
            shared[twin].append(name)
    return {n: group for group in shared.values() for n in group}


def gptq_weights(module: nn.Module, names: set[str], samples: list[list[int]], window: int, group_size: int,
                 hessians: dict[str, torch.Tensor] | None = None) -> dict:
    """GPTQ int4 values and scales for the named linears, as `given` takes them; layers reading the
    same input (q, k, v; w1, w3) are solved together (one Hessian). `hessians`: their X^T X, when
    already measured (quantize's calibration pass), else measured on `samples`."""
    if hessians is None:
        hessians = input_hessians(module, names, samples, window)[0]
    shared = shared_inputs(hessians)
    out = {}
    for name in sorted(names):
        if f"{name}.weight" in out:
            continue
        group = [n for n in shared.get(name, [name]) if n in names]
        weights = [module.get_submodule(n).weight for n in group]
        q, d = gptq_qparams(torch.cat(weights), hessians[name], group_size)
        for n, qi, di in zip(group, q.split([w.shape[0] for w in weights]), d.split([w.shape[0] for w in weights])):
            out[f"{n}.weight"] = (qi.clone(), di.clone())  # each layer its own storage, not a view of the joint solve
    return out


def gptq_names(decoder: nn.Module, options: QuantOptions) -> set[str]:
    """The linears GPTQ rounds: the decoder's 8da4w ones."""
    return {n for n, recipe in linear_recipes(decoder, options).items() if recipe == "8da4w"}


def gptq_int4(prepared: PreparedModel, decoder: nn.Module, options: QuantOptions,
              hessians: dict[str, torch.Tensor] | None = None) -> dict:
    """GPTQ's int4 weights for the decoder's 8da4w linears, on gptq_samples (or their `hessians`,
    measured already); the decoder's KV cache is left as it was."""
    started = time.perf_counter()
    names = gptq_names(decoder, options)
    samples = gptq_samples(prepared, options)
    state = {k: v.clone() for k, v in decoder.named_buffers()}  # the KV cache, as it was
    from genai_pipeline.upstream.executorch_logs import native_logs_hidden

    with native_logs_hidden():  # ExecuTorch's custom ops log from C++ in eager mode too
        computed = gptq_weights(decoder, names, samples, prepared.options.max_seq_len, options.group_size, hessians)
    for k, v in decoder.named_buffers():
        v.copy_(state[k])
    log.info("gptq: %d layers on %d calibration tokens in %.0f s", len(names), sum(map(len, samples)), time.perf_counter() - started)
    return computed


def budget_room(decoder: nn.Module, options: QuantOptions, n_methods: int) -> float:
    """The bytes a size budget leaves for 8-bit layers beyond a program of n_methods methods with
    every candidate at 4 bits (size_budget.program_bytes, graph_bytes); a budget below it is refused."""
    from genai_pipeline import size_budget

    n_layers = len(decoder.layers)
    smallest = dataclasses.replace(options, promoted=())
    floor = (size_budget.program_bytes(decoder, lambda n: recipe_for(n, smallest, n_layers), options.embedding, options.group_size)
             + size_budget.graph_bytes(n_layers, n_methods))
    if floor > options.size_budget * 1e6:
        raise InputError(f"--size-budget {options.size_budget:g} MB is too small: with every layer at 4 bits this program takes "
                         f"{floor / 1e6:.2f} MB; raise the budget")
    return options.size_budget * 1e6 - floor


def with_promoted(prepared: PreparedModel, decoder: nn.Module, options: QuantOptions, int4: Mapping, room: float) -> QuantOptions:
    """`options` with the linears its size budget keeps at 8 bits within `room` more bytes
    (budget_room; size_budget.py), measured on held_out_tokens with each candidate at the 4-bit
    values the export stores (`int4`: gptq's or a GGUF's, else the weight rule's) or at 8da8w's."""
    from genai_pipeline import size_budget

    def dequantized(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return q.float() * d.float().repeat_interleave(q.shape[1] // d.shape[1], dim=1)

    n_layers = len(decoder.layers)
    smallest = dataclasses.replace(options, promoted=())
    four_bit, eight_bit, rule = {}, {}, RULES[options.weight_rule]
    for name, m in decoder.named_modules():
        if isinstance(m, nn.Linear) and name.startswith("layers.") and recipe_for(name, smallest, n_layers) == "8da4w":
            four_bit[name] = dequantized(*(int4.get(f"{name}.weight") or rule(m.weight, options.group_size)))
            eight_bit[name] = dequantized(*torchao_qparams(m.weight, m.in_features, bits=8, bf16=False))  # torchao's 8da8w rule
    tokens, window = held_out_tokens(prepared, options), min(size_budget.SENSITIVITY_WINDOW, prepared.options.max_seq_len)
    windows = [tokens[i : i + window] for i in range(0, len(tokens), window)]
    return dataclasses.replace(options, promoted=size_budget.promote(decoder, four_bit, eight_bit, windows, room, options.group_size))


def gptq_samples(prepared: PreparedModel, options: QuantOptions) -> list[list[int]]:
    """gptq's (and smoothing's) calibration tokens: --calib's samples, else the first GPTQ_TOKENS of
    DEFAULT_GPTQ_TEXT; with a size budget, without the tokens held out for it (held_out_tokens)."""
    return _calibration_split(prepared, options)[0]


def held_out_tokens(prepared: PreparedModel, options: QuantOptions) -> list[int]:
    """A size budget's measuring text (size_budget.SENSITIVITY_TOKENS): DEFAULT_GPTQ_TEXT's tokens
    after gptq's, or the last tokens of --calib's samples, which gptq then does not fit."""
    return _calibration_split(prepared, options)[1]


def _calibration_split(prepared: PreparedModel, options: QuantOptions) -> tuple[list[list[int]], list[int]]:
    from genai_pipeline.size_budget import SENSITIVITY_TOKENS
    from genai_pipeline.tokenizer import Tokenizer

    checkpoint = prepared.tokenizer_file.parent if prepared.tokenizer_file else None
    if checkpoint is None:
        raise InputError("--recipe 8da4w calibrates its 4-bit weights (gptq) on text, and the checkpoint has no tokenizer; "
                         "pass a checkpoint with one, or set the weight rule to mse")
    tokenizer = Tokenizer.from_folder(checkpoint, bos_id=prepared.spec.bos_id)
    if options.calibration.datasets:
        from genai_pipeline.data.calibration import calibration_tokens

        samples = calibration_tokens(options.calibration, tokenizer, vocab_size=prepared.config.vocab_size,
                                     chat_template=read_chat_template(checkpoint), seed=prepared.options.seed)
        if options.size_budget is None:
            return samples, []
        held, fit = [], [list(sample) for sample in samples]
        while fit and len(held) < SENSITIVITY_TOKENS:  # from the end, splitting the last sample it needs
            take = min(SENSITIVITY_TOKENS - len(held), len(fit[-1]))
            held = fit[-1][len(fit[-1]) - take :] + held
            fit[-1] = fit[-1][: len(fit[-1]) - take]
            if not fit[-1]:
                fit.pop()
        if sum(map(len, fit)) < SENSITIVITY_TOKENS:
            raise InputError(f"--size-budget measures layers on {SENSITIVITY_TOKENS} calibration tokens that gptq does not fit: "
                             f"give --calib data of at least {2 * SENSITIVITY_TOKENS} tokens, or no --calib")
        return fit, held
    ids = tokenizer.encode(DEFAULT_GPTQ_TEXT.read_text(encoding="utf-8"))
    return [ids[:GPTQ_TOKENS]], ids[GPTQ_TOKENS : GPTQ_TOKENS + SENSITIVITY_TOKENS]


@torch.no_grad()
def input_absmax(module: nn.Module, samples: list[list[int]], window: int) -> dict[str, torch.Tensor]:
    """Per input channel, the largest magnitude each linear layer's input reaches over `samples`."""
    return input_statistics(module, samples, window)[0]


@torch.no_grad()
def input_statistics(module: nn.Module, samples: list[list[int]], window: int,
                     hessian_names: set[str] = frozenset()) -> tuple[dict, dict]:
    """One pass over `samples` (observe_inputs) for both calibrations: per linear, each input
    channel's largest magnitude (smoothing's); for the linears in `hessian_names`, X^T X of their
    inputs (GPTQ's)."""
    absmax, hessians = {}, {}

    def record(name: str, x: torch.Tensor) -> None:
        a = x.abs().amax(0)
        absmax[name] = torch.maximum(absmax[name], a) if name in absmax else a
        if name in hessian_names:
            hessians[name] = hessians.get(name, 0) + x.T @ x

    observe_inputs(module, {n for n, m in module.named_modules() if isinstance(m, nn.Linear)}, samples, window, record)
    return absmax, hessians


def smoothing_scales(module: nn.Module, absmax: dict[str, torch.Tensor], alpha: float = SMOOTH_ALPHA) -> dict[str, torch.Tensor]:
    """SmoothQuant's per-channel factors s = absmax(x)^alpha / absmax(W)^(1 - alpha) for each
    input that a float op before it can absorb (see smooth): the norms' outputs, the gate product
    w2 reads (through w3) and the attention output wo reads (through wv; one factor per KV head's
    channel, shared by the query heads that read it). {site: s}, sites named by the layer that
    absorbs 1/s."""
    scales = {}
    for i, block in enumerate(getattr(module, "layers", ())):
        p = f"layers.{i}."

        def factor(names):
            a = absmax.get(p + names[0])
            if a is None:
                return None
            w = torch.stack([module.get_submodule(p + n).weight.detach().float().abs().amax(0) for n in names]).amax(0)
            return (a.clamp(min=1e-5) ** alpha / w.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)

        for site, names in (*block.NORM_READERS.items(), ("feed_forward.w3", ["feed_forward.w2"]), ("attention.wv", ["attention.wo"])):
            s = factor(names)
            if s is None:
                continue
            if site == "attention.wv":  # wo's input channel (head h, d) is v's (kv head of h, d)
                att = block.attention
                s = s.view(att.n_kv_heads, att.n_heads // att.n_kv_heads, att.head_dim).amax(1).reshape(-1)
            scales[p + site] = s
    return scales


@torch.no_grad()
def smooth(module: nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """Fold `scales` (smoothing_scales) into the float weights: the model computes the same function
    (up to rounding), but the inputs of the linears after each site are divided by s channel by
    channel and their weights' columns multiplied by s, so that per-token int8 activations lose
    less to the few channels with outliers. Nothing changes in the graph: the programs run in
    ExecuTorch's stock runners as before."""
    for site, s in scales.items():
        layer, kind = _split_site(site)
        block = module.get_submodule(layer)
        if kind in ("attention_norm", "ffn_norm"):
            norm = getattr(block, kind)
            if norm.unit_offset:  # x * (1 + w)
                norm.weight.copy_((1 + norm.weight) / s - 1)
            else:
                norm.weight.div_(s)
        elif kind == "feed_forward.w3":
            block.feed_forward.w3.weight.div_(s[:, None])
        elif kind == "attention.wv":
            att = block.attention
            att.wv.weight.div_(s[:, None])
            if att.wv.bias is not None:
                att.wv.bias.div_(s)
    for name, s in smoothed_inputs(module, scales).items():
        module.get_submodule(name).weight.mul_(s)


def smoothed_inputs(module: nn.Module, scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{linear: the factor smooth(scales) divides its input by, channel by channel}: a norm's
    readers, w2 (after w3), wo (after wv: each query head's channel takes its KV head's factor)."""
    readers = {}
    for site, s in scales.items():
        layer, kind = _split_site(site)
        block = module.get_submodule(layer)
        if kind in ("attention_norm", "ffn_norm"):
            for name in block.NORM_READERS[kind]:
                readers[f"{layer}.{name}"] = s
        elif kind == "feed_forward.w3":
            readers[f"{layer}.feed_forward.w2"] = s
        elif kind == "attention.wv":
            att = block.attention
            per_head = s.view(att.n_kv_heads, 1, att.head_dim).expand(att.n_kv_heads, att.n_heads // att.n_kv_heads, att.head_dim)
            readers[f"{layer}.attention.wo"] = per_head.reshape(-1)
    return readers


def _split_site(site: str) -> tuple[str, str]:
    """A smoothing site's block and kind: "layers.3.attention.wv" -> ("layers.3", "attention.wv")."""
    prefix, index, kind = site.split(".", 2)
    return f"{prefix}.{index}", kind


def smoothed_hessians(hessians: dict[str, torch.Tensor], divided: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """X^T X of the inputs after smoothing, from those measured before it: an input divided by s
    channel by channel (smoothed_inputs) has X^T X divided by s s^T. Saves GPTQ a second pass."""
    return {n: h / (divided[n][:, None] * divided[n][None, :]) if n in divided else h for n, h in hessians.items()}


def smoothing_file(folder: Path, artifact_key: str) -> Path:
    """Where an export keeps the smoothing factors it folded into the float weights, for `genai eval`."""
    return Path(folder) / f"{artifact_key}.smoothing.pt"


def int4_file(folder: Path, artifact_key: str) -> Path:
    """Where an export keeps the int4 weights it computed (gptq), for `genai eval` to rebuild its QDQ model."""
    return Path(folder) / f"{artifact_key}.int4.pt"


def save_int4(path: Path, given: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    packed = {}
    for name, (q, d) in given.items():
        u = (q.to(torch.int16) + 8).to(torch.uint8).reshape(-1)
        packed[name] = {"shape": tuple(q.shape), "nibbles": u[1::2] << 4 | u[::2], "scale": d.to(torch.bfloat16)}
    tmp = path.with_name(path.name + ".partial")
    torch.save(packed, tmp)
    tmp.replace(path)


def load_int4(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for name, p in torch.load(path, weights_only=True).items():
        u = torch.stack([p["nibbles"] & 15, p["nibbles"] >> 4], dim=1).reshape(p["shape"])
        out[name] = (u.to(torch.int16) - 8).to(torch.int8), p["scale"].float()
    return out


RULES = {"mse": mse_qparams, "q4_0": q4_0_qparams, "torchao": torchao_qparams, "gptq": mse_qparams}  # gptq: without calibration


def _given_qparams(name: str, q: torch.Tensor, d: torch.Tensor, shape: torch.Size, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Given int4 values and group scales (e.g. a GGUF's Q4_0 blocks) as XNNPACK can run them:
    a block with a negative scale (llama.cpp's d < 0) is negated; its -8s would become +8, out of
    range, and are clamped to +7 (logged: the only values this path changes)."""
    q, d = q.to(torch.int8), d.float()
    if tuple(q.shape) != tuple(shape) or d.dim() != 2 or d.shape[0] != shape[0] or shape[1] != d.shape[1] * group:
        raise InputError(f"given weight of {name}: integers {tuple(q.shape)} and scales {tuple(d.shape)} "
                         f"do not match the layer's {tuple(shape)} in groups of {group} (--group-size)")
    if int(q.min()) < -8 or int(q.max()) > 7:
        raise InputError(f"given weight of {name}: integers outside [-8, 7]")
    negative = (d < 0).repeat_interleave(group, dim=1)
    if negative.any():
        clamped = int((negative & (q == -8)).sum())
        q = torch.where(negative, -q.to(torch.int16), q.to(torch.int16)).clamp(-8, 7).to(torch.int8)
        d = d.abs()
        if clamped:
            log.warning("%s: %d of %d given int4 values are -8 under a negative scale; stored as +7 of the "
                        "negated scale (XNNPACK takes positive scales only)", name, clamped, q.numel())
    return q, d


def quantize_module(module: nn.Module, options: QuantOptions, given: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> dict[str, str]:
    """Quantize `module` in place; returns the recipe given to each layer.

    `given` maps a linear's weight name (`layers.0.attention.wq.weight`) to int4 values [out, in]
    in [-8, 7] and fp32 scales [out, in // 32] (a GGUF's Q4_0 blocks): with recipe 8da4w and group
    size 32 that layer takes them as they are instead of quantizing its float weight. XNNPACK
    stores group scales as bf16, so a scale keeps its value only if bf16 holds it."""
    from torchao.quantization import quantize_

    given = dict(given or {})
    plan = {}
    if options.embedding:
        dim = next(m.embedding_dim for m in module.modules() if isinstance(m, nn.Embedding))
        if options.embedding == "4w" and dim % options.group_size:
            raise InputError(f"the embedding width {dim} is not a multiple of --group-size {options.group_size}; use --embedding 8w")
        tied_head = given.get("output.weight") if getattr(getattr(module, "config", None), "tie_embeddings", False) else None
        if options.embedding == "4w" and options.weight_rule != "torchao":
            for m in module.modules():
                if isinstance(m, nn.Embedding):
                    # the head takes given weights unless an override names it (see below)
                    if tied_head is not None and options.recipe == "8da4w" and not any(re.search(p, HEAD) for p, _ in options.overrides):
                        # One table for lookup and head, as the checkpoint has: the head's int4 values
                        # (chosen by gptq, or a GGUF's), which the program then stores once (compile).
                        q, d = _given_qparams("output.weight", *tied_head, m.weight.shape, options.group_size)
                    else:
                        q, d = RULES[options.weight_rule](m.weight, options.group_size)
                    m.weight = nn.Parameter(intx_weight(q, d, 4, m.weight.dtype, dynamic=False), requires_grad=False)
        else:
            quantize_(module, _embedding_config(options.embedding, options.group_size), filter_fn=lambda m, _: isinstance(m, nn.Embedding))
        plan.update({n: f"emb{options.embedding}" for n, m in module.named_modules() if isinstance(m, nn.Embedding)})
    linears = linear_recipes(module, options)
    for name in linears:  # given int4 weights outrank the automatic 8-bit layers (AUTO_HEAD, AUTO_8BIT), not --quant-override
        if f"{name}.weight" in given and options.recipe == "8da4w" and not any(re.search(p, name) for p, _ in options.overrides):
            linears[name] = "8da4w"
    unknown = sorted(set(given) - {f"{n}.weight" for n in linears})
    if unknown:
        raise InputError(f"given weights for layers the model does not have: {', '.join(unknown[:3])}")
    check_group_size(module, linears, options.group_size)
    for recipe in sorted(set(linears.values()) - {"fp32"}):
        chosen = {n for n, r in linears.items() if r == recipe}
        if recipe == "8da4w" and options.weight_rule != "torchao" or recipe == "8da4w" and given:
            for name in sorted(chosen):
                linear = module.get_submodule(name)
                key = f"{name}.weight"
                if key in given:
                    q, d = _given_qparams(key, *given.pop(key), linear.weight.shape, options.group_size)
                else:
                    q, d = RULES[options.weight_rule](linear.weight, options.group_size)
                linear.weight = nn.Parameter(intx_weight(q, d, 4, linear.weight.dtype), requires_grad=False)
        else:
            quantize_(module, linear_config(recipe, options.group_size), filter_fn=lambda m, fqn, chosen=chosen: fqn in chosen)
    if given:
        raise InputError(f"given int4 weights need recipe 8da4w on their layers: {', '.join(sorted(given)[:3])} got "
                         f"{', '.join(sorted({linears[k[: -len('.weight')]] for k in given}))}")
    plan.update(linears)
    return plan


def recipe_counts(plan: Mapping[str, str]) -> dict[str, int]:
    """{recipe: how many layers of `plan` ({layer: recipe}, quantize_module's) took it}, by recipe."""
    return {r: sum(1 for v in plan.values() if v == r) for r in sorted(set(plan.values()))}


def with_default_data(calibration: CalibrationOptions) -> CalibrationOptions:
    """No --calib given: random tokens (calibrating on them warns that accuracy will suffer)."""
    return calibration if calibration.datasets else dataclasses.replace(calibration, datasets=("random",))


def _calibrate(prepared: PreparedModel, artifact: Artifact, options: QuantOptions, quantizer):
    """PT2E on the quantize graph: observe activations over the calibration data, then convert."""
    from genai_pipeline.upstream.executorch_logs import native_logs_hidden
    from genai_pipeline.tokenizer import Tokenizer

    graph = artifact.quantize_graph
    checkpoint = prepared.tokenizer_file.parent if prepared.tokenizer_file else None
    tokenizer = Tokenizer.from_folder(checkpoint, bos_id=prepared.spec.bos_id) if checkpoint else None
    data = with_default_data(options.calibration)
    if any(d.kind == "random" for d in data.datasets):  # here, where activation ranges are really set from them
        log.warning("calibrating %s on RANDOM tokens: the quantized model's accuracy will suffer; "
                    "pass real data with --calib text:FILE (or messages, hf-chat, lm-eval)", artifact.key.value)
    steps = calibration_steps(
        data,
        tokenizer,
        chunk_len=prepared.options.prefill_len,
        max_seq_len=prepared.options.max_seq_len,
        vocab_size=prepared.config.vocab_size,
        chat_template=read_chat_template(checkpoint) if checkpoint else None,
        seed=prepared.options.seed,
    )

    def run(observed) -> None:
        feed = _cache_io_feed(observed, graph.metadata["cache_io"]) if "cache_io" in graph.metadata else None
        for step in iterate_with_progress(steps, f"calibrating {artifact.key.value}"):
            # A new sample restarts at position 0: causal attention never reads the stale rows.
            with native_logs_hidden():  # ExecuTorch's custom ops log from C++ in eager mode too
                if feed is not None:
                    feed(step)
                else:
                    observed(step.tokens[:, : step.n_real], step.input_pos)

    return calibrated_graph(graph, quantizer, run)


def calibrated_graph(graph: GraphBundle, quantizer, run: Callable[[nn.Module], None]):
    """PT2E on one graph: exported, annotated by `quantizer` (the exported graph module -> a PT2E
    quantizer), `run(observed)` feeds the calibration data through the observed module, then
    converted; the QDQ model, exported again (an ExportedProgram) with the graph's inputs."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    exported = torch.export.export(graph.module, graph.example_inputs, dynamic_shapes=graph.dynamic_shapes, strict=False)
    observed = prepare_pt2e(exported.module(), quantizer(exported.graph_module))
    with torch.no_grad():
        run(observed)
    qdq = convert_pt2e(observed)
    return torch.export.export(qdq, graph.example_inputs, dynamic_shapes=graph.dynamic_shapes, strict=False)


def _cache_io_feed(observed, contract):
    """Calibration of a cache-I/O quantize graph: each step's chunk goes through the runtime's own
    driver (runtime/cache_io.py), which owns the KV cache and builds positions and masks as a
    device does (a chunk shorter than the prefill length left-padded), so the observers see the
    inputs the deploy graphs will see."""
    from genai_pipeline.names import GraphName
    from genai_pipeline.runtime.cache_io import CacheIOSession, eager_runner

    session = CacheIOSession(contract, eager_runner({GraphName.PREFILL: observed, GraphName.DECODE: observed}, contract.n_layers))

    def feed(step) -> None:  # a sample's chunks come in order, so the driver's cursor is the step's input_pos
        if step.reset_cache:
            session.reset()
        session.prefill(step.tokens[0, : step.n_real].tolist())

    return feed


def next_token_only(qdq) -> nn.Module:
    """The calibrated QDQ model as a deploy graph: the next token's logits only, [1, vocab], as
    every deploy graph returns them (prepare's DecoderGraph(last_only=True)). The quantize graph
    computes every position's logits so that calibration sees every position; here the rows are
    dropped where the float decoder drops them, at the final norm's input: the norm and the LM head
    work row by row, so the last row's values are unchanged and the LM head runs on one row, not
    a whole prefill chunk. The graph is the same for every deploy graph: one set of encodings."""
    module = qdq.module()
    graph = module.graph

    def in_final_norm(node) -> bool:  # the decoder's top-level `norm` (DecoderGraph.decoder.norm), not a layer's
        stack = node.meta.get("nn_module_stack") or {}
        return any(re.fullmatch(r"(?:\w+\.)?norm", path) for path, _ in stack.values())

    order = {n: i for i, n in enumerate(graph.nodes)}
    norm_nodes = [n for n in graph.nodes if in_final_norm(n)]
    # The hidden states entering the norm: [1, T, dim] inputs computed before its first node (the
    # quantize/dequantize pairs between its own ops belong to no module, so they come after).
    inputs = {
        a for n in norm_nodes for a in n.all_input_nodes
        if order[a] < order[norm_nodes[0]] and getattr(a.meta.get("val"), "ndim", 0) == 3
    } if norm_nodes else set()
    if not inputs:
        raise RuntimeError("the QDQ model has no final norm to take the last row at")
    for hidden in inputs:
        with graph.inserting_after(hidden):
            last = graph.call_function(torch.ops.aten.select.int, (hidden, 1, -1))
        for n in norm_nodes:
            n.replace_input_with(hidden, last)
    graph.lint()
    module.recompile()
    return module


def _fingerprint(path: Path, h) -> None:
    """Names, sizes and modification times of a file or of every file below a folder."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        stat = f.stat()
        h.update(f"{f}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())


def qdq_key(prepared: PreparedModel, options: QuantOptions, target_name: str) -> str:
    """A hash of everything calibration depends on: the model and its weights, the quantize
    graph's shape options, the recipe, and the calibration data files."""
    h = hashlib.sha256()
    o = prepared.options
    inputs = {
        "model": prepared.spec.name, "weights": prepared.weights, "config": dataclasses.asdict(prepared.config),
        "max_seq_len": o.max_seq_len, "prefill_len": o.prefill_len, "seed": o.seed, "target": target_name,
        "quant": dataclasses.asdict(options), "versions": tool_versions(),
    }
    h.update(json.dumps(inputs, sort_keys=True, default=str).encode())
    sources = [Path(prepared.weights)] if prepared.weights != "random" else []
    sources += [d.path for d in options.calibration.datasets if d.arg and d.path.exists()]
    for source in sources:
        _fingerprint(source, h)
    return h.hexdigest()


def _cached_qdq(cache: Path | None, key: str, artifact: Artifact):
    if cache is None:
        return None
    qdq, stamp = cache / f"{artifact.key.value}.qdq.pt2", cache / f".{artifact.key.value}.qdq.key"
    if qdq.is_file() and stamp.is_file() and stamp.read_text().strip() == key:
        log.info("reusing the calibrated %s (its inputs have not changed)", qdq)
        return torch.export.load(qdq)
    return None


def checkpoint_int4(prepared: PreparedModel, options: QuantOptions) -> dict | None:
    """A GGUF checkpoint's Q4_0 tensors where the recipe's grid is the file's (8da4w, group 32:
    symmetric int4, one scale per 32 weights): the program then holds the integers and scales
    llama.cpp runs, not a re-quantization of their dequantized values."""
    from genai_pipeline.checkpoints import gguf

    if options.recipe != "8da4w" or options.group_size != 32 or prepared.weights == "random":
        return None
    file = gguf.gguf_file(Path(prepared.weights))
    if file is None:
        return None
    q4_0 = gguf.read_q4_0(file)
    if prepared.config.tie_embeddings and "tok_embeddings.weight" in q4_0:
        q4_0["output.weight"] = q4_0["tok_embeddings.weight"]  # llama.cpp stores a tied head once, as token_embd
    linears = {f"{n}.weight" for n, m in next(iter(prepared.artifacts.values())).module.named_modules() if isinstance(m, nn.Linear)}
    q4_0 = {name: values for name, values in q4_0.items() if name in linears}
    if q4_0:
        log.info("taking %d Q4_0 tensors of %s as they are", len(q4_0), file.name)
    return q4_0 or None


def check_group_size(module: nn.Module, linears: Mapping[str, str], group_size: int) -> None:
    """Refuse a group size that does not divide the input width of every int4 linear (`linears`:
    name -> recipe). quantize() asks before calibrating, which would otherwise fail on it first."""
    widths = {module.get_submodule(n).in_features for n, recipe in linears.items() if "4w" in recipe}
    bad = sorted(w for w in widths if w % group_size)
    if bad:
        fits = [g for g in (16, 32, 64, 128, 256) if all(w % g == 0 for w in widths)]
        raise InputError(f"--group-size {group_size} does not divide the input width of the model's int4 layers "
                         f"({', '.join(map(str, bad))}); use --group-size {' or '.join(map(str, fits)) or '8'}")


def quantize(prepared: PreparedModel, options: QuantOptions, target, cache: Path | None = None,
             given: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None) -> PreparedModel:
    """`target` (a targets.Target) supplies the quantizer of static recipes. With `cache` (the
    output folder of an earlier export), a QDQ model calibrated there on the same inputs is reused.
    `given`: int4 weights taken as they are (see quantize_module)."""
    if prepared.spec.vision is not None:
        from genai_pipeline.quantize_multimodal import quantize_vision_language

        return quantize_vision_language(prepared, options, target)
    if options.vision_recipe is not None:
        raise InputError(f"--vision-recipe applies to vision-language models; {prepared.spec.name} is a text model")
    if options.size_budget is not None and prepared.options.cache_io:
        raise InputError("--size-budget needs the decoder's own KV cache to measure layers; drop --cache-io")
    if options.is_float:
        return prepared
    for artifact in prepared.artifacts.values():
        check_group_size(artifact.module, linear_recipes(artifact.module, options), options.group_size)
    if given is None:
        given = checkpoint_int4(prepared, options)
    if options.rotate and (given or not all(can_rotate(a.module) for a in prepared.artifacts.values())):
        options = dataclasses.replace(options, rotate=False)  # a GGUF's given int4 values fit its own basis only
    artifacts = {}
    for key, artifact in prepared.artifacts.items():
        if options.is_static:
            stamp = qdq_key(prepared, options, target.name)
            qdq = _cached_qdq(cache, stamp, artifact)
            if qdq is None:
                qdq = _calibrate(prepared, artifact, options, lambda gm: target.static_quantizer(options, gm))
                log.info("quantized %s statically (%s), calibrated on %s", key.value, options.recipe,
                         ", ".join(map(str, with_default_data(options.calibration).datasets)))
            deploy = next_token_only(qdq)
            graphs = {name: dataclasses.replace(g, module=deploy) for name, g in artifact.graphs.items()}
            artifact = dataclasses.replace(artifact, graphs=graphs, qdq=qdq, qdq_key=stamp)
        else:
            computed, scales, hessians = None, None, None
            gptq = options.recipe == "8da4w" and options.weight_rule == "gptq" and not given
            if options.rotate:
                rotate(artifact.module)
                log.info("rotated the residual stream (%s)", "head rotation added" if artifact.module.head_rotation is not None else "no head rotation")
            if options.smooth is not None and not given:  # a GGUF's given int4 values fit its own float weights only
                started = time.perf_counter()
                samples = gptq_samples(prepared, options)
                state = {k: v.clone() for k, v in artifact.module.named_buffers()}  # the KV cache, as it was
                from genai_pipeline.upstream.executorch_logs import native_logs_hidden

                with native_logs_hidden():  # ExecuTorch's custom ops log from C++ in eager mode too
                    # GPTQ calibrates on the same samples: its X^T X come from the same pass
                    absmax, hessians = input_statistics(artifact.module, samples, prepared.options.max_seq_len,
                                                        gptq_names(artifact.module, options) if gptq else frozenset())
                scales = smoothing_scales(artifact.module, absmax, options.smooth)
                for k, v in artifact.module.named_buffers():
                    v.copy_(state[k])
                smooth(artifact.module, scales)
                hessians = smoothed_hessians(hessians, smoothed_inputs(artifact.module, scales)) if gptq else None
                log.info("smoothed %d activation sites (alpha %g) on %d calibration tokens in %.0f s", len(scales), options.smooth,
                         sum(map(len, samples)), time.perf_counter() - started)
            room = budget_room(artifact.module, options, len(artifact.graphs)) if options.size_budget is not None and options.promoted is None else None
            if gptq:
                computed = gptq_int4(prepared, artifact.module, options, hessians)  # every candidate of a size budget, too
            if room is not None:
                options = with_promoted(prepared, artifact.module, options, computed or given or {}, room)
                chosen = {f"{n}.weight" for n in options.promoted}  # these are stored at 8 bits instead
                computed = computed and {k: v for k, v in computed.items() if k not in chosen}
                given = given and {k: v for k, v in given.items() if k not in chosen}
            plan = quantize_module(artifact.module, options, computed or given)
            # compile writes them beside the program: `genai eval` rebuilds the quantized model from them
            artifact = dataclasses.replace(artifact, int4=computed or given or None, smoothing=scales)
            log.info("quantized %s: %s", key.value, ", ".join(f"{n} layers {r}" for r, n in recipe_counts(plan).items()))
        artifacts[key] = artifact
    return dataclasses.replace(
        prepared, artifacts=artifacts, recipe=options.describe(), quantization=dataclasses.asdict(options)
    )
