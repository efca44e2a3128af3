"""export: THE pipeline. A registry entry or a checkpoint -> prepare -> quantize -> compile -> verify
-> report, built in a staging folder beside `out` and swapped in whole when complete.

`genai export`, the Python API (`genai_pipeline.export`), the benchmark scripts and the tests'
fixtures all call export(); nothing else chains the stages. The caller hands in a configured
target (the CLI turns its QNN flags into one) and sees errors as GenAIError subclasses whose
message a user can act on; progress goes to this module's logger.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import shutil
from pathlib import Path

from genai_pipeline.artifacts import ArtifactSet
from genai_pipeline.checkpoints import infer_checkpoint_spec
from genai_pipeline.checkpoints.gguf import gguf_file
from genai_pipeline.compile import compile_artifacts
from genai_pipeline.data import calibration_tokens
from genai_pipeline.errors import ExportError, InputError
from genai_pipeline.evaluate.report import write_quant_report
from genai_pipeline.evaluate.verify import Verification, verify_export
from genai_pipeline.export_folder import MANIFEST, check_out_folder, make_staging_folder, publish, recover_interrupted
from genai_pipeline.heap import trim
from genai_pipeline.manifest import Manifest
from genai_pipeline.options import DEFAULT_MODEL, PrepareOptions, QuantOptions
from genai_pipeline.prepare import prepare
from genai_pipeline.quantize import check_speech_quant, quantize
from genai_pipeline.quantize.calibration import calibrating, calibration_free, with_default_data
from genai_pipeline.quantize.multimodal import check_vision_language_quant
from genai_pipeline.registry import ModelSpec, get_spec
from genai_pipeline.stages import peak_rss_so_far_mb, recording, stage
from genai_pipeline.targets import Target, check_recipe, get_target
from genai_pipeline.tokenizer import Tokenizer, find_tokenizer_file

log = logging.getLogger(__name__)


def export(
    model: str | None = None,
    *,
    out: str | Path,
    checkpoint: str | Path | None = None,
    prepare: PrepareOptions = PrepareOptions(),
    quant: QuantOptions = QuantOptions(),
    target: str | Target = "xnnpack",
    verify: bool = True,
) -> ArtifactSet:
    """Export `model` (a registry name, `genai models`; None: the entry inferred from `checkpoint`,
    else DEFAULT_MODEL) into the folder `out`, and return what is there.

    `checkpoint`: a local Hugging Face folder, llama2.c folder or GGUF file (else `prepare.checkpoint`;
    neither: the entry's shipped weights, or random ones). `target`: a name (xnnpack, portable, qnn)
    or a configured Target (targets.qnn.configure). `verify`: a quantized program is scored against
    its float model and a quantization report written beside it, as `genai export` always does.

    `out` may be absent, empty, or an export of ours holding nothing else; it is replaced only when
    the new export is complete. A target that cannot lower on this host (QNN without its SDK)
    publishes its QDQ-only export, then raises ExportError saying why."""
    target = get_target(target) if isinstance(target, str) else target
    if checkpoint is not None:
        if prepare.checkpoint is not None and Path(prepare.checkpoint) != Path(checkpoint):
            raise InputError(f"two checkpoints given: '{checkpoint}' and prepare.checkpoint '{prepare.checkpoint}'")
        prepare = dataclasses.replace(prepare, checkpoint=Path(checkpoint))
    out = Path(out)
    recover_interrupted(out)
    check_out_folder(out, prepare.checkpoint)  # never replace what is not ours
    # Built beside `out` and swapped in when complete: a failed or interrupted export leaves the
    # previous one as it was, and nothing of the previous one lands in the new one.
    staging = make_staging_folder(out)  # also the check that `out` can be written, before any work
    try:
        with recording() as stages:
            blocked = _export(model, prepare, quant, target, out, staging, verify)
        _record_stages(staging, stages)
        publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # whatever stopped the export, its staging folder goes
    if blocked is not None:
        raise blocked
    manifest = Manifest.read(out)
    return ArtifactSet(out, {key: out / file for key, file in manifest.programs.items()}, manifest)


def _record_stages(staging: Path, stages) -> None:
    """Each stage's time and memory, and the export's peak RSS, into the manifest."""
    profile = {"stages": stages.as_manifest(), "peak_rss_mb": round(peak_rss_so_far_mb(), 1)}
    dataclasses.replace(Manifest.read(staging), export_stages=profile).write(staging)
    log.debug("export peak RSS %.2f GB", profile["peak_rss_mb"] / 1024)


def _spec(model: str | None, checkpoint: Path | None) -> ModelSpec:
    if model is None and checkpoint is not None:
        spec, source = infer_checkpoint_spec(checkpoint)
        log.info("model: %s (inferred from %s)", spec.name, source)
        return spec
    return get_spec(model or DEFAULT_MODEL)


def _export(
    model: str | None,
    options: PrepareOptions,
    quant: QuantOptions,
    target: Target,
    out: Path,
    staging: Path,
    verify: bool,
) -> ExportError | None:
    """The export, written into `staging`; the ExportError of a target that cannot lower on this
    host (a complete QDQ-only export, to be published before the error is told)."""
    spec = _spec(model, options.checkpoint)
    check_recipe(target, quant)  # refused before any work starts
    if spec.audio is not None:
        check_speech_quant(quant)
    elif spec.vision is not None:
        check_vision_language_quant(
            quant,
            split=options.split,
            target=target,
            image_attention_both_ways=spec.vision.config.bidirectional_image_attention,
            mrope=bool(spec.config.mrope_section),
        )
        if options.long_prefill_len:
            raise InputError(
                "--long-prefill-len applies to text models; a vision-language program prefills in --prefill-len chunks"
            )
    elif quant.vision_recipe is not None:
        raise InputError(f"--vision-recipe applies to vision-language models; {spec.name} is a text model")
    if target.cache_io and not options.cache_io:
        options = dataclasses.replace(options, cache_io=True)  # the form this target lowers
    quant = _calibration_checked(spec, options, quant)
    log.info("prepare %s (%s mode, max_seq_len %d)", spec.name, options.mode.value, options.max_seq_len)
    # A calibrated QDQ model of the previous export in `out` is reused when its key matches;
    # compile writes it into the staging folder with the rest.
    with stage("prepare"):
        # the weights a block at a time: quantize streams them (quantize/streaming.py)
        prepared = prepare(spec, options, lazy=True)
    prepared = quantize(prepared, quant, target, cache=out, weights_folder=staging)
    log.info("compile for %s (%s)", target.name, prepared.recipe)
    report_tokens = None if quant.is_float or not verify else _report_tokens(prepared, quant)
    blocked = None
    try:
        compile_artifacts(prepared, target, staging, release=True)  # the eager weights go once lowered
    except ExportError as e:
        if not (staging / MANIFEST).is_file():
            raise
        blocked = e
    # The report rebuilds the float and QDQ models from the manifest; the prepared model and its
    # lowered graphs go first, or both sets are held at once (the export's peak RSS).
    recipe, has_tokenizer = prepared.recipe, prepared.tokenizer_file is not None
    del prepared
    gc.collect()
    trim()
    if quant.is_float or not verify:
        return blocked
    verification = None
    if has_tokenizer:
        verification = _verify(staging, recipe, quant)
        # Its float model and program sit in reference cycles: held beside the report's (2 GB at 1B) until collected
        gc.collect()
        trim()
    else:
        log.warning("not verified against the float model: the checkpoint has no tokenizer to encode text with")
    with stage("report"):
        write_quant_report(staging, *report_tokens, verification=verification)  # before the swap: part of the folder
    return blocked


def _calibration_checked(spec: ModelSpec, options: PrepareOptions, quant: QuantOptions) -> QuantOptions:
    """`quant`, or where the weights have no tokenizer to calibrate with, decided before any work:
    random weights (a registry name without a checkpoint, for speed studies) take the recipe
    without calibration, said on one line; a checkpoint without one is refused, naming the fix."""
    wants = calibrating(quant)
    checkpoint = options.checkpoint or spec.checkpoint
    if not wants or (checkpoint is not None and _has_tokenizer(Path(checkpoint))):
        return quant
    if checkpoint is not None:
        raise InputError(
            f"--recipe {quant.recipe} calibrates on text ({', '.join(wants)}), and the checkpoint '{checkpoint}' has "
            "no tokenizer.json or tokenizer.model to encode it: add the model's tokenizer there, or pass --no-calibration"
        )
    if quant.calibration.datasets or quant.size_budget is not None:
        flag = "--calib" if quant.calibration.datasets else "--size-budget"
        raise InputError(
            f"{flag} measures on calibration text, and {spec.name} without a checkpoint has random weights and no "
            "tokenizer: pass --checkpoint DIR, or drop it"
        )
    instead = " (4-bit weights by mse, the same 8-bit layers)" if "GPTQ" in wants else ""
    log.warning(
        "%s has random weights and no tokenizer to calibrate with: %s without %s%s, as --no-calibration gives; "
        "pass --checkpoint DIR for the full recipe",
        spec.name,
        quant.recipe,
        " or ".join(wants),
        instead,
    )
    return calibration_free(quant)


def _has_tokenizer(checkpoint: Path) -> bool:
    """A checkpoint's tokenizer, found as prepare finds it (a GGUF carries its vocabulary); a
    checkpoint that does not exist passes, for prepare to say so."""
    return not checkpoint.exists() or gguf_file(checkpoint) is not None or find_tokenizer_file(checkpoint) is not None


def _verify(staging: Path, recipe: str, quant: QuantOptions) -> Verification:
    """The finished program scored against its float model: one line, recorded in the manifest,
    a warning past the thresholds (genai_pipeline/evaluate/verify.py)."""
    log.info("verifying the program against its float model")
    texts = [d.path for d in quant.calibration.datasets if d.kind == "text"]
    with stage("verify"):
        verification = verify_export(staging, recipe, texts)
    dataclasses.replace(Manifest.read(staging), verification=verification.as_manifest()).write(staging)
    log.info("%s", verification.line())
    if verification.warning:
        log.warning("WARNING: %s", verification.warning)
    return verification


def _report_tokens(prepared, quant: QuantOptions) -> tuple[list[int], str]:
    """The quantization report's input: tokens of the calibration data (random tokens without
    --calib), and a description of them. A dynamic recipe does not calibrate: the report says the
    tokens only measure its noise, and random tokens then carry no accuracy warning."""
    tokenizer = (
        Tokenizer.from_folder(prepared.tokenizer_file.parent, bos_id=prepared.spec.bos_id)
        if prepared.tokenizer_file
        else None
    )
    data = with_default_data(quant.calibration)
    samples = calibration_tokens(data, tokenizer, vocab_size=prepared.config.vocab_size, seed=prepared.options.seed)
    tokens = [t for sample in samples for t in sample][: min(256, prepared.options.max_seq_len)]
    source = ", ".join(map(str, data.datasets))
    if quant.is_static:
        return tokens, f"the calibration data ({source})"
    return (
        tokens,
        f"{source} data (only measured on: {quant.recipe} computes its activation scales at run time, nothing was calibrated)",
    )
