"""compile: lower every graph of an artifact into ONE ExecuTorch program, write a manifest last."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from genai_pipeline.artifacts import Artifact, ArtifactSet, PreparedModel
from genai_pipeline.chat_template import read_chat_template
from genai_pipeline.errors import ExportError
from genai_pipeline.export_folder import (
    MANIFEST,
    atomic_write,
    sha256,
    tool_versions,
    weights_fingerprint,
)
from genai_pipeline.heap import move_to_file, page_out, trim
from genai_pipeline.manifest import COMPLETE, QDQ_ONLY, ArtifactEntry, FileEntry, Manifest
from genai_pipeline.names import GraphName
from genai_pipeline.quantize import qdq_cache
from genai_pipeline.stages import stage
from genai_pipeline.targets import Target
from genai_pipeline.upstream.executorch_lowered_modules import release_delegated_weights
from genai_pipeline.upstream.executorch_program_manager import store_shared_bytes_once
from genai_pipeline.upstream.exir_lowering import lower_grouped, to_edge_transform_and_lower
from genai_pipeline.upstream.torch_export_caches import forget_lowered_graphs

log = logging.getLogger(__name__)

RUNTIME_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
)


def lower(artifact: Artifact, target: Target, progress: tqdm, weights_file: Path | None = None):
    """The artifact's graphs exported and lowered to the target (an EdgeProgramManager).
    `weights_file`: where the eager weights are moved to first (map_weights_to_file)."""
    programs = {}
    # One form for all methods: they share their weights only if they take them alike. A hybrid
    # program's `prefill` and `verify` (any length) take the static methods' form
    static_shapes = all(
        graph.dynamic_shapes is None
        for name, graph in artifact.graphs.items()
        if name not in (GraphName.PREFILL, GraphName.VERIFY)
    )
    with stage("adapt for lowering"):
        for graph in artifact.graphs.values():
            target.adapt_for_lowering(graph.module, static_shapes)
    if weights_file is not None:
        with stage("map weights to file"):
            map_weights_to_file(artifact, weights_file)
    for name, graph in artifact.graphs.items():
        progress.set_description(f"export {artifact.key.value}.{name.value}")
        with stage("torch.export"):
            programs[name.value] = torch.export.export(
                graph.module, graph.example_inputs, dynamic_shapes=graph.dynamic_shapes, strict=False
            )
        progress.update()
    progress.set_description(f"lower {artifact.key.value} to {target.name}")
    with stage("lower"):
        if target.grouped is not None:  # several methods in one payload (QNN context binaries)
            edge = lower_grouped(programs, target.grouped(tuple(programs)), dict(artifact.constant_methods))
        else:
            edge = to_edge_transform_and_lower(programs, target.partitioners(), dict(artifact.constant_methods))
    progress.update()
    return edge


def to_executorch(
    artifact: Artifact,
    target: Target,
    progress: tqdm,
    quantized: bool,
    release: bool = False,
    folder: Path | None = None,
):
    """The artifact's graphs lowered and emitted as one program (an ExecutorchProgramManager).
    `release`: the eager module's weights moved to a file in `folder` before lowering (map_weights_to_file)
    and let go once lowered (release_weights)."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass

    if quantized:
        import executorch.kernels.quantized  # noqa: F401  out-variants of the quantized ops

    weights_file = folder / f".{artifact.key.value}.weights" if release and folder is not None else None
    edge = lower(artifact, target, progress, weights_file)
    if release:
        release_weights(artifact)
        release_delegated_weights(edge)  # the delegates' copies: serialized into their named data
        trim()
    progress.set_description(f"emit {artifact.key.value}.pte")
    config = ExecutorchBackendConfig(
        # Same-named mutable buffers (the KV cache) get one place shared by all methods:
        # decode reads what prefill wrote.
        memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True),
        emit_mutable_buffer_names=True,
        # Fuses torchao's quantized-embedding pattern into ExecuTorch's quantized kernels.
        do_quant_fusion_and_const_prop=quantized,
    )
    with stage("emit"):
        program = edge.to_executorch(config)
        # A tied embedding: the delegated LM head reads the table the lookup reads.
        store_shared_bytes_once(program, config)
    progress.update()
    return program


def map_weights_to_file(artifact: Artifact, path: Path) -> int:
    """The artifact's eager weights moved into a memory-mapped file (heap.move_to_file), before
    they are exported. Lowering reads every weight once to serialize it for the backend, and the
    serialized bytes pile up to the program's size; meanwhile the weights stayed resident, the
    export's peak (a 3B model's 3.6 GB of int8 weights beside its 2 GB program). As file pages,
    XNNPACK's preprocess gives them back once their partition is serialized
    (upstream/xnnpack_preprocess.py). The module runs as before. Returns the bytes moved."""
    moved = move_to_file(artifact.module.parameters(), path)
    trim()
    log.debug("%s: %.0f MB of weights mapped from a file", artifact.key.value, moved / 2**20)
    return moved


def release_weights(artifact: Artifact) -> None:
    """The artifact's eager weights moved to the meta device once its graphs are lowered: what a
    backend took (XNNPACK packs its own copy) is freed before the program is emitted, and what the
    lowered graphs still hold stays alive through them. The module can no longer run."""
    for module in artifact.module.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            meta = torch.empty(p.shape, dtype=p.dtype, device="meta")  # a torchao weight too (no empty_like)
            setattr(module, name, torch.nn.Parameter(meta, requires_grad=False))
    trim()


def _compile_spec(prepared: PreparedModel, target: Target) -> dict | None:
    """The backend's compile spec, decoded, when it has one (QNN: SoC, HTP arch, ...), also for a
    QDQ-only export; per artifact when there are several."""
    specs = {key.value: target.compile_spec(tuple(g.value for g in a.graphs)) for key, a in prepared.artifacts.items()}
    specs = {key: spec for key, spec in specs.items() if spec is not None}
    if not specs:
        return None
    return next(iter(specs.values())) if len(specs) == 1 else specs


def _copy(src: Path, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.partial")
    shutil.copyfile(src, tmp)
    tmp.replace(dest)


def _lower_all(prepared: PreparedModel, target: Target, out: Path, release: bool) -> dict:
    programs = {}
    steps = sum(len(a.graphs) + 2 for a in prepared.artifacts.values())
    with tqdm(total=steps, unit="step", leave=False, dynamic_ncols=True) as progress:
        for key, artifact in prepared.artifacts.items():
            try:
                program = to_executorch(artifact, target, progress, prepared.recipe != "fp32", release, out)
            except Exception as e:  # torch.export / lowering failures: say which artifact, keep the cause
                first_line = str(e).splitlines()[0] if str(e) else ""
                raise ExportError(
                    f"lowering {key.value} to {target.name} failed: {type(e).__name__}: {first_line}"
                ) from e
            programs[key] = out / f"{key.value}.pte"
            # Streamed to the file piece by piece: `program.buffer` would hold a second copy of
            # every weight in memory at once (~5 GB for a 1B model in fp32).
            with stage("write"):
                atomic_write(programs[key], program.write_to_file)
            del program
            forget_lowered_graphs()
            trim()
    return programs


def _qdq_files(key, qdq) -> dict:
    """Where an artifact's QDQ models go: `<artifact>.qdq.pt2`, or with one per calibrated graph
    (a vision-language program: its tower and its text decoder) `<artifact>.<graph>.qdq.pt2`."""
    if not isinstance(qdq, dict):
        return {None: f"{key.value}.qdq.pt2"}
    return {graph: f"{key.value}.{graph.value}.qdq.pt2" for graph in qdq}


def _qdq_manifest(key, qdq):
    """The manifest's `qdq` of an artifact: a file name, {graph: file name}, or None."""
    if qdq is None:
        return None
    files = _qdq_files(key, qdq)
    return files[None] if None in files else {graph.value: file for graph, file in files.items()}


def _chosen(artifact: Artifact) -> tuple[str, ...]:
    """What the quantize stage chose for `artifact` that its program alone does not give back: int4
    weights (GPTQ's, a GGUF's) and smoothing factors, which `genai eval` rebuilds its QDQ model with."""
    return tuple(name for name, value in (("int4", artifact.int4), ("smoothing", artifact.smoothing)) if value)


def _write_chosen(prepared: PreparedModel, out: Path, release: bool) -> dict:
    """What each artifact's quantize stage chose (_chosen), written beside the programs as the QDQ
    cache keeps it, before lowering: {artifact key: file}; `release`: then let go in memory. The
    lowered graphs hold their own copies of the int4 weights (fused projections are new tensors),
    so a second one would stay resident through lowering (1.9 GB for a 3B model)."""
    files = {}
    for key, artifact in prepared.artifacts.items():
        if _chosen(artifact):
            files[key] = out / f".{key.value}.chosen.pt"
            qdq_cache.write(files[key], qdq_cache.Chosen(artifact.int4, artifact.smoothing))
            page_out(t for pair in (artifact.int4 or {}).values() for t in pair)  # read from their file, if moved
            if release:  # the prepared model is not used again (compile_artifacts); the dicts are its
                for chosen in (artifact.int4, artifact.smoothing):
                    if isinstance(chosen, dict):
                        chosen.clear()
    return files


def compile_artifacts(prepared: PreparedModel, target: Target, out: Path, release: bool = False) -> ArtifactSet:
    """Writes `<artifact>.pte` (+ `<artifact>.qdq.pt2` when calibrated), the tokenizer, and the
    manifest last, into `out`: a new or empty folder (`genai export` passes its staging folder, see
    export_folder.publish), since the manifest lists every file there. What the quantize stage chose
    for `genai eval` (int4 weights, smoothing factors) goes to the QDQ cache under the program's
    digest (quantize/qdq_cache.py), not into `out`. Where the target cannot lower on
    this host (no vendor SDK), the QDQ models and a manifest with status `qdq-only` are written,
    then ExportError says why. `release`: each artifact's eager weights and chosen values are let go once lowered
    (the prepared model cannot run after; `genai export` has no more use for it)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(p for p in out.iterdir() if not p.name.startswith(".")):
        raise ExportError(
            f"{out} is not empty: an export is written into a new folder (genai export builds one, then swaps it in)"
        )
    started = time.perf_counter()
    for key, artifact in prepared.artifacts.items():
        if artifact.qdq is not None:  # the calibrated model(s), for `genai eval`
            qdq = artifact.qdq if isinstance(artifact.qdq, dict) else {None: artifact.qdq}
            for graph, file in _qdq_files(key, artifact.qdq).items():
                tmp = (
                    out / f".{file.removesuffix('.pt2')}.partial.pt2"
                )  # torch.export.save warns on a name not ending in .pt2
                torch.export.save(qdq[graph], tmp)
                tmp.replace(out / file)
            if artifact.qdq_key:  # lets a re-run reuse it
                atomic_write(out / f".{key.value}.qdq.key", artifact.qdq_key)
    blocked = target.lowering_blocked()
    chosen = {key: _chosen(artifact) for key, artifact in prepared.artifacts.items()}
    with stage("write chosen values"):
        chosen_files = {} if blocked else _write_chosen(prepared, out, release)
    programs = {} if blocked else _lower_all(prepared, target, out, release)
    if prepared.tokenizer_file is not None:  # tokenizer.json or tokenizer.model, under its own name
        _copy(prepared.tokenizer_file, out / prepared.tokenizer_file.name)
        # What a chat runtime needs beside it: special tokens and the chat template.
        for name in RUNTIME_FILES:
            if (prepared.tokenizer_file.parent / name).is_file():
                _copy(prepared.tokenizer_file.parent / name, out / name)
    if prepared.spec.chat_template is not None and read_chat_template(out) is None:
        # The entry's template stands in for a checkpoint without one: `genai run --chat` reads only the folder.
        atomic_write(out / "chat_template.jinja", prepared.spec.chat_template)
    files = {
        path.name: FileEntry(path.stat().st_size, sha256(path))
        for path in sorted(out.iterdir())
        if path.is_file() and not path.name.startswith(".") and path.name != MANIFEST
    }
    for key, written in chosen_files.items():  # for `genai eval`, outside the folder (qdq_cache.py)
        qdq_cache.keep(files[programs[key].name].sha256, written)
    options = prepared.options
    manifest = Manifest(
        model=prepared.spec.name,
        entry=prepared.spec.entry,
        family=prepared.spec.family,
        weights=prepared.weights,
        # What `genai eval` and the quantization report rebuild the float model from, and how
        # they know the weights are still the ones exported.
        checkpoint=None if prepared.weights == "random" else weights_fingerprint(Path(prepared.weights)),
        config=prepared.config,
        recipe=prepared.recipe,
        quantization=dict(prepared.quantization),
        seed=options.seed,
        target=target.name,
        compile_spec=_compile_spec(prepared, target),
        mode=options.mode,
        max_seq_len=options.max_seq_len,
        prefill_len=options.prefill_len,
        bos_id=prepared.spec.bos_id,
        eos_ids=tuple(prepared.spec.eos_ids),
        special_tokens=prepared.special_tokens.as_manifest() if prepared.special_tokens else None,
        status=QDQ_ONLY if blocked else COMPLETE,
        artifacts={
            key: ArtifactEntry(
                file=programs[key].name if key in programs else None,
                qdq=_qdq_manifest(key, artifact.qdq),
                methods=tuple(g.value for g in artifact.graphs),
                dynamic_methods=tuple(
                    g.value for g, graph in artifact.graphs.items() if graph.dynamic_shapes is not None
                ),
                constant_methods=dict(artifact.constant_methods),
                chosen=chosen[key] if key in programs else (),
            )
            for key, artifact in prepared.artifacts.items()
        },
        vision=prepared.vision,
        audio=prepared.audio,
        decoder_form=prepared.decoder_form,
        cache_io=prepared.cache_io,
        files=files,
        export_seconds=round(time.perf_counter() - started, 2),
        versions=tool_versions(),
    )
    manifest.write(out)
    if blocked:
        raise ExportError(f"{blocked} in {out}")
    # debug: `genai export` says where the folder ends up, not its staging folder
    log.debug("wrote %s (%s) in %.1f s", out, ", ".join(p.name for p in programs.values()), manifest.export_seconds)
    return ArtifactSet(folder=out, programs=programs, manifest=manifest)
