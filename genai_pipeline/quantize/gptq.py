"""quantize, GPTQ (Frantar et al. 2022): int4 weights rounded against the Hessian of each layer's
inputs."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from genai_pipeline.artifacts import PreparedModel
from genai_pipeline.options import QuantOptions
from genai_pipeline.quantize.calibration import gptq_samples, input_statistics
from genai_pipeline.quantize.recipes import linear_recipes
from genai_pipeline.quantize.weights import wmse_qparams

log = logging.getLogger(__name__)


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
                d = wmse_qparams(W1[:, i : i + group_size], group_size, importance[i1 + i : i1 + i + group_size])[1][
                    :, 0
                ]
                D[:, (i1 + i) // group_size] = d
            q = torch.clamp(torch.round(W1[:, i] / d), -8, 7)
            Q[:, i1 + i] = q.to(torch.int8)
            E1[:, i] = (W1[:, i] - q * d) / Hi[i, i]
            W1[:, i:] -= E1[:, i : i + 1] * Hi[i, i:][None, :]
        W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
    return Q, D


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
        twin = next(
            (n for n in shared if n.rpartition(".")[0] == parent and torch.equal(hessians[n], hessians[name])), None
        )
        if twin is None:
            shared[name] = [name]
        else:
            shared[twin].append(name)
    return {n: group for group in shared.values() for n in group}


def gptq_weights(
    module: nn.Module,
    names: set[str],
    samples: list[list[int]],
    window: int,
    group_size: int,
    hessians: dict[str, torch.Tensor] | None = None,
) -> dict:
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


def gptq_int4(
    prepared: PreparedModel, decoder: nn.Module, options: QuantOptions, hessians: dict[str, torch.Tensor] | None = None
) -> dict:
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
    log.info(
        "gptq: %d layers on %d calibration tokens in %.0f s",
        len(names),
        sum(map(len, samples)),
        time.perf_counter() - started,
    )
    return computed
