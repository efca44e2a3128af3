"""quantize, for a text model: rotation, smoothing, GPTQ, a size budget's promotions, then the
recipes (dynamic); or PT2E calibration (static)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from genai_pipeline.artifacts import PreparedModel
from genai_pipeline.errors import InputError
from genai_pipeline.options import QuantOptions
from genai_pipeline.quantize.calibration import gptq_samples, input_statistics, with_default_data
from genai_pipeline.quantize.gptq import gptq_int4, gptq_names
from genai_pipeline.quantize.recipes import (
    check_group_size,
    describe,
    linear_recipes,
    quantize_module,
    recipe_counts,
    rules_for,
)
from genai_pipeline.quantize.rotation import can_rotate, rotate
from genai_pipeline.quantize.size_budget import budget_room, with_promoted
from genai_pipeline.quantize.smoothing import smooth, smoothed_hessians, smoothed_inputs, smoothing_scales
from genai_pipeline.quantize.static import cached_qdq, calibrate, next_token_only, qdq_key
from genai_pipeline.quantize.weights import checkpoint_int4

log = logging.getLogger(__name__)


def quantize_text(
    prepared: PreparedModel,
    options: QuantOptions,
    target,
    cache: Path | None = None,
    given: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> PreparedModel:
    """`target` (a targets.Target) supplies the quantizer of static recipes. With `cache` (the
    output folder of an earlier export), a QDQ model calibrated there on the same inputs is reused.
    `given`: int4 weights taken as they are (see quantize_module)."""
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
            computed, scales, hessians = None, None, None
            gptq = options.weight_rule == "gptq" and not given and bool(gptq_names(artifact.module, options))
            if options.rotate:
                rotate(artifact.module)
                log.info(
                    "rotated the residual stream (%s)",
                    "head rotation added" if artifact.module.head_rotation is not None else "no head rotation",
                )
            if options.smooth is not None and not given:  # a GGUF's given int4 values fit its own float weights only
                started = time.perf_counter()
                samples = gptq_samples(prepared, options)
                state = {k: v.clone() for k, v in artifact.module.named_buffers()}  # the KV cache, as it was
                from genai_pipeline.upstream.executorch_logs import native_logs_hidden

                with native_logs_hidden():  # ExecuTorch's custom ops log from C++ in eager mode too
                    # GPTQ calibrates on the same samples: its X^T X come from the same pass
                    absmax, hessians = input_statistics(
                        artifact.module,
                        samples,
                        prepared.options.max_seq_len,
                        gptq_names(artifact.module, options) if gptq else frozenset(),
                    )
                scales = smoothing_scales(artifact.module, absmax, options.smooth)
                for k, v in artifact.module.named_buffers():
                    v.copy_(state[k])
                smooth(artifact.module, scales)
                hessians = smoothed_hessians(hessians, smoothed_inputs(artifact.module, scales)) if gptq else None
                log.info(
                    "smoothed %d activation sites (alpha %g) on %d calibration tokens in %.0f s",
                    len(scales),
                    options.smooth,
                    sum(map(len, samples)),
                    time.perf_counter() - started,
                )
            room = (
                budget_room(artifact.module, options, len(artifact.graphs))
                if options.size_budget is not None and options.promoted is None
                else None
            )
            if gptq:
                computed = gptq_int4(
                    prepared, artifact.module, options, hessians
                )  # every candidate of a size budget, too
            if room is not None:
                options = with_promoted(prepared, artifact.module, options, computed or given or {}, room)
                chosen = {f"{n}.weight" for n in options.promoted}  # these are stored at 8 bits instead
                computed = computed and {k: v for k, v in computed.items() if k not in chosen}
                given = given and {k: v for k, v in given.items() if k not in chosen}
            int4 = computed or given or {}
            taken = [k.removesuffix(".weight") for k in int4]
            # the rules applied, which the manifest records and `genai eval` applies again
            options = dataclasses.replace(options, rules=rules_for(options, len(artifact.module.layers), taken))
            plan = quantize_module(artifact.module, options, int4)
            # compile writes them beside the program: `genai eval` rebuilds the quantized model from them
            artifact = dataclasses.replace(artifact, int4=int4 or None, smoothing=scales)
            log.info(
                "quantized %s: %s", key.value, ", ".join(f"{n} layers {r}" for r, n in recipe_counts(plan).items())
            )
        artifacts[key] = artifact
    return dataclasses.replace(
        prepared, artifacts=artifacts, recipe=describe(options), quantization=dataclasses.asdict(options)
    )
