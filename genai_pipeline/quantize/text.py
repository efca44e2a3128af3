"""quantize, for a text model: rotation, smoothing, GPTQ, a size budget's promotions, then the
recipes (dynamic); or PT2E calibration (static)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from genai_pipeline.artifacts import PreparedModel
from genai_pipeline.errors import InputError
from genai_pipeline.options import QuantOptions
from genai_pipeline.quantize.calibration import gptq_samples, with_default_data
from genai_pipeline.quantize.gptq import gptq_names
from genai_pipeline.quantize.recipes import (
    HEAD,
    check_group_size,
    describe,
    for_decoder,
    linear_recipes,
    quantize_module,
    recipe_counts,
    rules_for,
    split_tied_table,
    table_8bit_rows,
)
from genai_pipeline.quantize.rotation import can_rotate, rotates_inputs
from genai_pipeline.quantize.size_budget import budget_room, with_promoted
from genai_pipeline.quantize.static import cached_qdq, calibrate, next_token_only, qdq_key
from genai_pipeline.quantize.streaming import Calibration, quantize_blocks
from genai_pipeline.quantize.weights import checkpoint_int4

log = logging.getLogger(__name__)


def quantize_text(
    prepared: PreparedModel,
    options: QuantOptions,
    target,
    cache: Path | None = None,
    given: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    weights_folder: Path | None = None,
) -> PreparedModel:
    """`target` (a targets.Target) supplies the quantizer of static recipes. With `cache` (the
    output folder of an earlier export), a QDQ model calibrated there on the same inputs is reused.
    `given`: int4 weights taken as they are (see quantize_module). `weights_folder`: a folder on
    disk the quantized weights are moved to, memory-mapped, block by block (streaming.quantize_blocks)."""
    if options.vision_recipe is not None:
        raise InputError(f"--vision-recipe applies to vision-language models; {prepared.spec.name} is a text model")
    if options.size_budget is not None and prepared.options.cache_io:
        raise InputError("--size-budget needs the decoder's own KV cache to measure layers; drop --cache-io")
    if options.is_float or options.is_static:  # the whole float model: exported as it is, or calibrated whole
        for artifact in prepared.artifacts.values():
            if prepared.loader is not None:
                prepared.loader.load_all(artifact.module)
        prepared = dataclasses.replace(prepared, loader=None)
    if options.is_float:
        return prepared
    for artifact in prepared.artifacts.values():
        check_group_size(artifact.module, linear_recipes(artifact.module, options), options.group_size)
    if given is None:
        given = checkpoint_int4(prepared, options)
    decoders = [a.module for a in prepared.artifacts.values()]
    for decoder in decoders:
        options = for_decoder(options, decoder)
    if options.rotate and (given or not all(can_rotate(d) or rotates_inputs(d) for d in decoders)):
        options = dataclasses.replace(options, rotate=False)  # a GGUF's given int4 values fit its own basis only
    if options.rotate and options.smooth is not None and any(rotates_inputs(d) for d in decoders):
        # every site SmoothQuant would smooth is rotated instead (docs/decisions/0040)
        options = dataclasses.replace(options, smooth=None)
    artifacts = {}
    for key, artifact in prepared.artifacts.items():
        if options.is_static:
            stamp = qdq_key(prepared, options, target.name)
            qdq = cached_qdq(cache, stamp, artifact)
            if qdq is None:
                qdq = calibrate(prepared, artifact, options, lambda gm: target.static_quantizer(options, gm))
                log.info(
                    "quantized %s statically (%s), calibrated on %s",
                    key.value,
                    options.recipe,
                    ", ".join(map(str, with_default_data(options.calibration).datasets)),
                )
            deploy = next_token_only(qdq)
            graphs = {name: dataclasses.replace(g, module=deploy) for name, g in artifact.graphs.items()}
            artifact = dataclasses.replace(artifact, graphs=graphs, qdq=qdq, qdq_key=stamp)
        else:
            artifact, options = _quantize_dynamic(prepared, artifact, options, given, weights_folder)
        artifacts[key] = artifact
    return dataclasses.replace(
        prepared, artifacts=artifacts, recipe=describe(options), quantization=dataclasses.asdict(options), loader=None
    )


def _quantize_dynamic(prepared: PreparedModel, artifact, options: QuantOptions, given, weights_folder: Path | None):
    """A dynamic recipe on the text decoder, block by block (streaming.py); with a size budget, its
    choice of 8-bit layers made on the whole model after. The artifact with its chosen int4 weights
    and smoothing scales (compile keeps them in the QDQ cache, qdq_cache.py), and the options with the rules
    applied (the manifest records them; `genai eval` applies them again)."""
    decoder = artifact.module
    head = linear_recipes(decoder, options, [k.removesuffix(".weight") for k in given or {}]).get(HEAD)
    options = dataclasses.replace(options, table_8bit_rows=table_8bit_rows(options, decoder, head))  # recorded
    gptq = options.weight_rule == "gptq" and not given and bool(gptq_names(decoder, options))
    measure = gptq or (
        options.smooth is not None and not given
    )  # a GGUF's given int4 values fit its own float weights only
    calibration = Calibration(gptq_samples(prepared, options), prepared.options.max_seq_len) if measure else None
    budget = options.size_budget is not None and options.promoted is None
    if budget:  # a budget too small is refused before any work (from the layers' shapes: the model may be unloaded)
        budget_room(decoder, options, len(artifact.graphs))
    streamed = quantize_blocks(
        decoder, prepared.loader, options, calibration, given, defer=budget, weights_folder=weights_folder
    )
    if options.rotate and rotates_inputs(decoder):
        log.info("rotated the inputs of every block's linears at run time (sandwich norms: not the residual stream)")
    elif options.rotate:
        log.info(
            "rotated the residual stream (%s)",
            "head rotation added" if decoder.head_rotation is not None else "no head rotation",
        )
    if streamed.scales:
        log.info("smoothed %d activation sites (alpha %g)", len(streamed.scales), options.smooth)
    int4 = streamed.int4 or given or {}
    if budget:
        room = budget_room(decoder, options, len(artifact.graphs))  # rotated: its float head rotation counts
        options = with_promoted(prepared, decoder, options, int4, room)
        chosen = {f"{n}.weight" for n in options.promoted}  # these are stored at 8 bits instead
        int4 = {k: v for k, v in int4.items() if k not in chosen}
    taken = [k.removesuffix(".weight") for k in int4]
    options = dataclasses.replace(options, rules=rules_for(options, len(decoder.layers), taken))
    if budget:
        given = dict(int4)  # `int4` keeps the whole head's values: what eval is given again
        if options.table_8bit_rows:  # the budget's choice of the table's first rows
            split_tied_table(decoder, options.table_8bit_rows, given)
        plan = quantize_module(decoder, options, given)
    else:
        plan = streamed.plan
    log.info(
        "quantized %s: %s", artifact.key.value, ", ".join(f"{n} layers {r}" for r, n in recipe_counts(plan).items())
    )
    return dataclasses.replace(artifact, int4=int4 or None, smoothing=streamed.scales or None), options
