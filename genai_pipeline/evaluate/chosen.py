"""eval, what an export chose beside its recipe that its QDQ model is rebuilt with (int4 weights,
smoothing factors; quantize/qdq_cache.py): from the QDQ cache, else chosen again from the
checkpoint as the export did."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch

from genai_pipeline.errors import InputError
from genai_pipeline.export_folder import int4_file, smoothing_file
from genai_pipeline.manifest import Manifest
from genai_pipeline.names import ArtifactKey
from genai_pipeline.options import PrepareOptions, quant_options_from
from genai_pipeline.prepare import prepare
from genai_pipeline.quantize import qdq_cache, quantize
from genai_pipeline.quantize.qdq_cache import Chosen
from genai_pipeline.quantize.weights import load_int4
from genai_pipeline.registry import get_spec

log = logging.getLogger(__name__)


def chosen_values(folder: Path, manifest: Manifest, key: ArtifactKey) -> Chosen:
    """What the export chose for the program of `key` beside its recipe (int4 weights, smoothing
    factors): from the QDQ cache, under the program's digest; where it has none there (a folder
    from another machine, a cleared cache), chosen again from the checkpoint as the export did, and
    stored. An export of an earlier version kept them in its folder: read there."""
    legacy = int4_file(folder, key.value), smoothing_file(folder, key.value)
    if any(path.is_file() for path in legacy):
        int4, scales = legacy
        return Chosen(
            load_int4(int4) if int4.is_file() else None,
            torch.load(scales, weights_only=True) if scales.is_file() else None,
        )
    entry = manifest.artifacts[key]
    if not entry.chosen:
        return Chosen()
    digest = manifest.files[entry.file].sha256
    cached = qdq_cache.load(digest)
    if cached is not None:
        return cached
    what = " and ".join({"int4": "int4 weights", "smoothing": "smoothing factors"}[c] for c in entry.chosen)
    checkpoint = None if manifest.weights == "random" else manifest.checkpoint_path
    if checkpoint is not None and not checkpoint.exists():
        raise InputError(
            f"the {what} of {entry.file} are not in the QDQ cache ({qdq_cache.cache_folder()}) and its checkpoint "
            f"{manifest.checkpoint_path} is gone: run this where the export ran, or put the checkpoint back there"
        )
    log.info(
        "the %s of %s are not in the QDQ cache (%s): choosing them again from %s as the export did, stored there after",
        what,
        entry.file,
        qdq_cache.cache_folder(),
        checkpoint or f"random weights (seed {manifest.seed})",
    )
    chosen = _chosen_again(manifest, key, checkpoint)
    qdq_cache.store(digest, chosen)
    return chosen


def _chosen_again(manifest: Manifest, key: ArtifactKey, checkpoint: Path | None) -> Chosen:
    """The export's quantize stage run again on its checkpoint, with the options it recorded (its
    rules, its calibration data): GPTQ and smoothing give the same values on the same inputs."""
    options = PrepareOptions(
        mode=manifest.mode,
        max_seq_len=manifest.max_seq_len,
        prefill_len=manifest.prefill_len,
        long_prefill_len=0,
        checkpoint=checkpoint,
        seed=manifest.seed,
        cache_io=manifest.decoder_form is not None,
    )
    with _quiet("genai_pipeline.prepare", "genai_pipeline.quantize", "genai_pipeline.checkpoints"):
        prepared = prepare(get_spec(manifest.entry), options, lazy=True)
        artifact = quantize(prepared, quant_options_from(manifest.quantization), target=None).artifacts[key]
    return Chosen(artifact.int4, artifact.smoothing)


@contextmanager
def _quiet(*loggers: str):
    """The export stages' progress lines held back while eval runs them again: eval says so in one."""
    levels = {name: logging.getLogger(name).level for name in loggers}
    for name in loggers:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
