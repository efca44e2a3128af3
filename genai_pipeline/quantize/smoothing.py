"""quantize, SmoothQuant: per-channel factors folded into the float weights before the dynamic
recipes quantize them."""

from __future__ import annotations

import logging

import torch
from torch import nn

from genai_pipeline.options import SMOOTH_ALPHA

log = logging.getLogger(__name__)


def smoothing_scales(
    module: nn.Module, absmax: dict[str, torch.Tensor], alpha: float = SMOOTH_ALPHA
) -> dict[str, torch.Tensor]:
    """SmoothQuant's per-channel factors s = absmax(x)^alpha / absmax(W)^(1 - alpha) for each
    input that a float op before it can absorb (see smooth): the norms' outputs, the gate product
    w2 reads (through w3) and the attention output wo reads (through wv; one factor per KV head's
    channel, shared by the query heads that read it). {site: s}, sites named by the layer that
    absorbs 1/s."""
    scales = {}
    for i, block in enumerate(getattr(module, "layers", ())):
        scales.update(block_smoothing_scales(block, f"layers.{i}.", absmax, alpha))
    return scales


def block_smoothing_scales(
    block: nn.Module, prefix: str, absmax: dict[str, torch.Tensor], alpha: float = SMOOTH_ALPHA
) -> dict[str, torch.Tensor]:
    """smoothing_scales of one block, whose layers `absmax` names with `prefix` (`layers.3.`)."""
    scales = {}

    def factor(names):
        a = absmax.get(prefix + names[0])
        if a is None:
            return None
        w = torch.stack([block.get_submodule(n).weight.detach().float().abs().amax(0) for n in names]).amax(0)
        return (a.clamp(min=1e-5) ** alpha / w.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)

    for site, names in (
        *block.norm_readers.items(),
        ("feed_forward.w3", ["feed_forward.w2"]),
        ("attention.wv", ["attention.wo"]),
    ):
        s = factor(names)
        if s is None:
            continue
        if site == "attention.wv":  # wo's input channel (head h, d) is v's (kv head of h, d)
            att = block.attention
            s = s.view(att.n_kv_heads, att.n_heads // att.n_kv_heads, att.head_dim).amax(1).reshape(-1)
        scales[prefix + site] = s
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
            for name in block.norm_readers[kind]:
                readers[f"{layer}.{name}"] = s
        elif kind == "feed_forward.w3":
            readers[f"{layer}.feed_forward.w2"] = s
        elif kind == "attention.wv":
            att = block.attention
            per_head = s.view(att.n_kv_heads, 1, att.head_dim).expand(
                att.n_kv_heads, att.n_heads // att.n_kv_heads, att.head_dim
            )
            readers[f"{layer}.attention.wo"] = per_head.reshape(-1)
    return readers


def _split_site(site: str) -> tuple[str, str]:
    """A smoothing site's block and kind: "layers.3.attention.wv" -> ("layers.3", "attention.wv")."""
    prefix, index, kind = site.split(".", 2)
    return f"{prefix}.{index}", kind


def smoothed_hessians(hessians: dict[str, torch.Tensor], divided: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """X^T X of the inputs after smoothing, from those measured before it (changed in place): an
    input divided by s channel by channel (smoothed_inputs) has X^T X divided by s s^T. Saves GPTQ a
    second pass."""
    for name, h in hessians.items():
        if name in divided:
            s = divided[name]
            for i in range(0, h.shape[0], 1024):  # in place, a band of rows at a time: no second n x n
                h[i : i + 1024].div_(s[i : i + 1024, None] * s[None, :])
    return hessians
