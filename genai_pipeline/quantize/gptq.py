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
def gptq_qparams(
    w: torch.Tensor, hessian: torch.Tensor, group_size: int, block: int = 128, damp: float = 0.01, band: int = 16384
):
    """GPTQ (Frantar et al. 2022) on a symmetric int4 grid: columns are rounded in order and each
    one's error is spread over the columns not yet rounded through the Cholesky factor of the
    inverse Hessian (X^T X of the layer's inputs); a group's scale is chosen (importance-weighted
    mse) when its first column comes up, from the weights as updated so far.

    Rows are independent given the Hessian: they are solved `band` at a time (a multiple of the
    4096-row bands below), so a 128k-row head holds one band in float, not a copy of itself.
    The errors are spread lazily (GPTQ's own blocking, applied twice): column by column within a
    group, a group's errors onto the rest of its `block` of columns by one product, a block's onto
    the columns after it by one product. Each block's columns are held as rows, so that the column
    by column work reads and writes contiguous memory."""
    H = hessian.detach().float().clone()
    rows, n = w.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    H.diagonal().add_(damp * torch.diag(H).mean())  # no n x n identity: w2's H is 0.8 GB in an 8B model
    importance = torch.diag(H).clone()
    Hinv = torch.cholesky_inverse(torch.linalg.cholesky(H))
    del H
    Hinv = torch.linalg.cholesky(Hinv, upper=True)
    Q, D = torch.empty(rows, n, dtype=torch.int8), torch.empty(rows, n // group_size)
    block = max(group_size, block // group_size * group_size)
    for r in range(0, rows, band):
        W = w[r : r + band].detach().float().clone()
        W[:, dead] = 0
        _gptq_rows(W, Hinv, importance, group_size, block, Q[r : r + band], D[r : r + band])
    return Q, D


def _gptq_rows(W, Hinv, importance, group_size: int, block: int, Q, D) -> None:
    """GPTQ's column loop over the rows `W` (float, updated in place), into their int4 values `Q`
    and scales `D`."""
    rows, n = W.shape
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        Wt, Et, Hi = W[:, i1:i2].T.contiguous(), torch.empty(i2 - i1, rows), Hinv[i1:i2, i1:i2]
        Qt = torch.empty(i2 - i1, rows, dtype=torch.int8)
        for g1 in range(0, i2 - i1, group_size):
            g2 = g1 + group_size
            d = wmse_qparams(Wt[g1:g2].T, group_size, importance[i1 + g1 : i1 + g2])[1][:, 0]
            D[:, (i1 + g1) // group_size] = d
            for i in range(g1, g2):
                q = torch.clamp(torch.round(Wt[i] / d), -8, 7)
                Qt[i] = q
                Et[i] = (Wt[i] - q * d) / Hi[i, i]
                Wt[i + 1 : g2].addmm_(Hi[i, i + 1 : g2, None], Et[i, None], alpha=-1)  # addr_ is 100x slower
            Wt[g2:].addmm_(Hi[g1:g2, g2:].T, Et[g1:g2], alpha=-1)
        Q[:, i1:i2] = Qt.T
        for r in range(0, rows, 4096):  # a band of rows at a time: no [rows, n] temporary
            W[r : r + 4096, i2:].addmm_(Et[:, r : r + 4096].T, Hinv[i1:i2, i2:], alpha=-1)


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
        # One layer solved alone is not copied first (a tied 128k-row head is GBs in float)
        q, d = gptq_qparams(torch.cat(weights) if len(weights) > 1 else weights[0], hessians[name], group_size)
        if len(weights) == 1:
            out[f"{name}.weight"] = (q, d)
            continue
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
