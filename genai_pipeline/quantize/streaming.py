"""quantize, a text decoder block by block: each block loaded in float, rotated, measured on the
calibration text, smoothed, rounded by GPTQ and quantized before the next is loaded, the calibration
hidden states carried from block to block. What stays in memory is the quantized model and one
float block, not the float model (an 8B one is 32 GB in float32).

The result is the whole-model pipeline's, bit for bit: every block's calibration inputs are the
outputs of the rotated float blocks before it, as in one pass of the whole rotated float model
(tests/quantize/test_streaming.py), so GPTQ sees the same Hessians and the program the same bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from genai_pipeline.checkpoints.block_loader import BlockLoader, release_outer
from genai_pipeline.errors import InputError
from genai_pipeline.heap import move_to_file, trim
from genai_pipeline.layer_rules import recipe_of
from genai_pipeline.models.decoder import KVCache
from genai_pipeline.options import QuantOptions
from genai_pipeline.quantize.calibration import InputStatistics, inputs_recorded
from genai_pipeline.quantize.gptq import gptq_weights
from genai_pipeline.quantize.recipes import (
    HEAD,
    quantize_embedding,
    quantize_linears,
    rules_for,
    split_tied_table,
    table_8bit_rows,
    table_part_recipes,
)
from genai_pipeline.quantize.rotation import (
    SEED,
    hadamard,
    rotate_block,
    rotate_embedding,
    rotate_head,
    rotate_inputs,
    rotates_inputs,
)
from genai_pipeline.quantize.smoothing import block_smoothing_scales, smooth, smoothed_hessians, smoothed_inputs
from genai_pipeline.stages import logged, peak_gb, stage
from genai_pipeline.upstream.executorch_logs import native_logs_hidden

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Calibration:
    """The text the blocks are measured on: token lists, run from position 0 in windows."""

    samples: list[list[int]]
    window: int


@dataclass(frozen=True)
class Streamed:
    """What streaming chose: GPTQ's int4 weights and the smoothing scales (both empty without), and
    the recipe each layer took ({} when deferred)."""

    int4: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scales: dict[str, torch.Tensor]
    plan: dict[str, str]


@torch.no_grad()
def quantize_blocks(
    decoder: nn.Module,
    loader: BlockLoader | None,
    options: QuantOptions,
    calibration: Calibration | None = None,
    given: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    scales: Mapping[str, torch.Tensor] | None = None,
    defer: bool = False,
    weights_folder: Path | None = None,
) -> Streamed:
    """Quantize `decoder` (a models.decoder.Decoder) block by block, in place, by `options`' rules.

    `loader`: where the weights not yet in `decoder` are (None: all are). `calibration`: the text
    smoothing (`options.smooth`) and GPTQ (`options.weight_rule` gptq) measure; None: neither runs.
    `given`: int4 weights taken as they are (a GGUF's, or an export's chosen ones when its quantized
    model is rebuilt); `scales`: smoothing scales to apply instead of measuring them. `defer`: leave
    the weights in float (smoothed, GPTQ's int4 chosen), for a size budget that chooses the 8-bit
    layers from the whole model. `weights_folder`: a folder on disk (the export's staging folder)
    each block's quantized weights and GPTQ's values for them are moved to once chosen (_to_file)."""
    n_layers = len(decoder.layers)
    given = dict(given or {})
    any_given = bool(given)
    rules = rules_for(options, n_layers, [k.removesuffix(".weight") for k in given])
    linears = {n: recipe_of(n, rules) for n, m in decoder.named_modules() if isinstance(m, nn.Linear)}
    unknown = sorted(set(given) - {f"{n}.weight" for n in linears})
    if unknown:
        raise InputError(f"given weights for layers the model does not have: {', '.join(unknown[:3])}")
    rows = table_8bit_rows(options, decoder, linears.get(HEAD))  # the table's first rows at 8 bits, split at the end
    gptq = set()
    if calibration is not None and options.weight_rule == "gptq" and not given:
        gptq = {n for n, recipe in linears.items() if recipe == "8da4w"}
    measure_smoothing = calibration is not None and options.smooth is not None and scales is None and not given
    measure = bool(gptq) or measure_smoothing
    chosen_scales = dict(scales or {})
    computed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    inputs_only = options.rotate and rotates_inputs(decoder)  # sandwich norms: the linears' inputs, at run time
    q = hadamard(decoder.config.dim, SEED) if options.rotate and not inputs_only else None

    def load_table() -> None:  # the token table in float, rotated
        if loader is not None:
            with stage("load", quiet=True):
                loader.load_outer(decoder, ("tok_embeddings.weight",))
        if q is not None:
            with stage("rotate", quiet=True):
                rotate_embedding(decoder, q)

    hidden = []
    if loader is None or measure:
        load_table()
    if measure:
        hidden = [
            decoder.embed(torch.tensor([sample[i : i + calibration.window]]))
            for sample in calibration.samples
            for i in range(0, len(sample), calibration.window)
        ]
        if loader is not None:  # read again for the head and the lookup: a 128k-row table is GBs in float
            release_outer(decoder, ("tok_embeddings.weight",))
    started = time.perf_counter()
    bar = tqdm(range(n_layers), desc="quantize blocks", unit="block", leave=False, dynamic_ncols=True)
    for i in bar:
        if log.isEnabledFor(logging.DEBUG) and peak_gb():
            bar.set_postfix_str(f"peak RSS {peak_gb()}")
        with stage("load", quiet=True):
            block = loader.load_block(decoder, i) if loader is not None else decoder.layers[i]
        prefix = f"layers.{i}."
        if q is not None:
            with stage("rotate", quiet=True):
                rotate_block(block, q)
        elif inputs_only:
            with stage("rotate", quiet=True):
                rotate_inputs(block, SEED)
        if measure:
            names = {n for n in linears if n.startswith(prefix)}
            statistics = InputStatistics(gptq & names)
            with stage("calibrate", quiet=True), _own_kv_cache(decoder, block):
                # ExecuTorch's custom ops (the KV cache's update, SDPA) log from C++ in eager mode too
                with inputs_recorded(block, names, statistics.record, prefix), native_logs_hidden():
                    hidden = [decoder.forward_block(i, x) for x in hidden]
            hessians = statistics.hessians
            if measure_smoothing:
                with stage("smooth", quiet=True):
                    block_scales = block_smoothing_scales(block, prefix, statistics.absmax, options.smooth)
                    smooth(decoder, block_scales)
                    hessians = smoothed_hessians(hessians, smoothed_inputs(decoder, block_scales))
                chosen_scales.update(block_scales)
            if gptq & names:
                with stage("gptq", quiet=True):
                    computed.update(_gptq(decoder, gptq & names, hessians, options.group_size))
        elif block_scales := {s: v for s, v in chosen_scales.items() if s.startswith(prefix)}:
            with stage("smooth", quiet=True):
                smooth(decoder, block_scales)
        if not defer:
            block_linears = {n: r for n, r in linears.items() if n.startswith(prefix)}
            with stage("quantize", quiet=True):
                _quantize(decoder, block_linears, options, given, computed, any_given)
                if weights_folder is not None:
                    chosen = [v for k, v in computed.items() if k.startswith(prefix)]
                    _to_file(block.parameters(), chosen, weights_folder / f".layers.{i}.weights")
        trim()  # the block's float weights and temporaries, back to the OS before the next is loaded

    if loader is not None:
        if decoder.tok_embeddings.weight.is_meta:
            load_table()
        with stage("load", quiet=True):
            loader.load_outer(decoder, ("norm.weight", "output.weight"))
    if q is not None:
        with stage("rotate", quiet=True):
            rotate_head(decoder, q)
        decoder.rotation_seed = SEED
    if measure and "output" in gptq:
        statistics = InputStatistics({"output"})
        for x in hidden:
            h = decoder.norm(x)
            statistics.record("output", (h if decoder.head_rotation is None else decoder.head_rotation(h))[0].float())
        with stage("gptq", quiet=True):
            computed.update(_gptq(decoder, {"output"}, statistics.hessians, options.group_size))
    if measure:
        log.info(
            "calibrated %d blocks on %d tokens in %.0f s (%s)",
            n_layers,
            sum(map(len, calibration.samples)),
            time.perf_counter() - started,
            ", ".join(p for p, on in (("smoothing", measure_smoothing), ("gptq", bool(gptq))) if on),
        )
    plan = {}
    if not defer:
        outer = {n: r for n, r in linears.items() if not n.startswith("layers.")}
        if decoder.head_rotation is not None:
            outer["head_rotation"] = linears["head_rotation"] = recipe_of("head_rotation", rules)
        outer_computed = dict(computed)  # `computed` keeps the whole head's values: what eval is given again
        if rows:  # the table's first rows at 8 bits: an 8da8w head part and an 8w lookup part
            split_tied_table(decoder, rows, given, outer_computed)
            outer.update(table_part_recipes(outer.pop(HEAD)))
            del linears[HEAD]
        with stage("quantize", quiet=True):
            plan = quantize_embedding(decoder, options, outer, {**given, **outer_computed}) | linears | outer
            _quantize(decoder, outer, options, given, outer_computed, any_given)
            if weights_folder is not None:
                weights = [p for n, p in decoder.named_parameters() if not n.startswith("layers.")]
                chosen = [v for k, v in computed.items() if not k.startswith("layers.")]
                _to_file(weights, chosen, weights_folder / ".outer.weights")
        logged(("load", "rotate", "calibrate", "smooth", "gptq", "quantize"))
        if given:
            raise InputError(
                f"given int4 weights need recipe 8da4w on their layers: {', '.join(sorted(given)[:3])} got "
                f"{', '.join(sorted({linears[k.removesuffix('.weight')] for k in given}))}"
            )
    return Streamed(computed, chosen_scales, plan)


def _quantize(
    decoder: nn.Module, linears: Mapping[str, str], options: QuantOptions, given: dict, computed: dict, any_given: bool
) -> None:
    """quantize_linears on `linears`, with the int4 values given (popped from `given`; those a layer's
    recipe did not take go back, for quantize_blocks to refuse) or chosen by GPTQ for them."""
    keys = {f"{n}.weight" for n in linears}
    taken = {k: given.pop(k) for k in keys & given.keys()} | {k: computed[k] for k in keys & computed.keys()}
    quantize_linears(decoder, linears, options, taken, any_given)
    given.update({k: v for k, v in taken.items() if k not in computed})


def _to_file(weights, chosen, path: Path) -> None:
    """Quantized weights and GPTQ's values for them (`chosen`: (int4 values, scales) pairs) moved
    to a memory-mapped file (heap.move_to_file): the quantized model is not read again until it is
    lowered, and held in memory it grew to the size of the int8 weights (7.5 GB for an 8B model)
    beside the next blocks' float work."""
    move_to_file([*weights, *(t for pair in chosen for t in pair)], path)


def _gptq(decoder: nn.Module, names: set[str], hessians: dict, group_size: int) -> dict:
    with native_logs_hidden():
        return gptq_weights(decoder, names, [], 0, group_size, hessians)


class _own_kv_cache:
    """A block of the cache-I/O form (no KV-cache buffers) runs from a cache of its own while it is
    measured; every block's cache is left empty after. A convolution block (LFM2) keeps its own."""

    def __init__(self, decoder: nn.Module, block: nn.Module):
        self.decoder, self.attention = decoder, block.attention
        self.added = self.attention is not None and self.attention.kv_cache is None

    def __enter__(self):
        if self.added:
            a = self.attention
            self.attention.kv_cache = KVCache(self.decoder.max_seq_len, a.n_kv_heads, a.head_dim)
        return self

    def __exit__(self, *exc):
        if self.attention is None:
            return
        if self.added:
            self.attention.kv_cache = None
        else:
            self.attention.kv_cache.k_cache.zero_()
            self.attention.kv_cache.v_cache.zero_()
