"""A sweep's task: one (model, variant) exported, verified, evaluated and benchmarked, as
`genai export`, `genai eval --json` and `genai bench --json` would do it by hand.

A task runs in two stages, each in a fresh worker process (run.py makes them Ray tasks):
`export_stage` (export through genai_pipeline.export, which verifies a quantized program, then
evaluate) and `bench_stage` (alone on its node). A vision-language model is evaluated on the spec's
image questions (`genai eval --images`) and on its text where the spec gives one, and benchmarked as
`genai bench` does a vision-language program (image encode, time to first token, prefill, decode).
Their figures are returned as small dicts; the export folder itself stays in the storage folder,
`STORAGE/<task>/export`, which every node sees.

A task is keyed by the content of its inputs (checkpoint files, options, evaluation text and image
questions, tool versions): run.py skips a task whose finished row has the same key, and the export
stage reuses an export whose export key matches (after a failure in evaluation or bench, only those
run again).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from genai_pipeline.errors import GenAIError, InputError
from genai_pipeline.options import BenchOptions, EvalOptions, ImageEvalOptions, PrepareOptions
from genai_pipeline.sweep.spec import Model, Spec, SpecError, Variant

EXPORT_RECORD = "export.json"  # the key of the export beside it
WORKERS = "workers.jsonl"  # a line per stage started: which process, on which host, in which run


@dataclass(frozen=True)
class Task:
    model: Model
    variant: Variant
    prepare: PrepareOptions
    eval: EvalOptions | None  # genai eval --text; None: not scored on text (a vision-language model)
    bench: BenchOptions
    images: ImageEvalOptions | None = None  # genai eval --images: a vision-language model's questions

    @property
    def name(self) -> str:
        return f"{self.model.name}--{self.variant.name}"

    def folder(self, storage: Path) -> Path:
        return Path(storage) / self.name

    def export_key(self) -> str:
        """A hash of what the export depends on: the checkpoint's files (size and mtime, as the QDQ
        cache's key), the options, the calibration files and the tools' versions."""
        from genai_pipeline.export_folder import tool_versions

        quant = self.variant.quant
        sources = [self.model.checkpoint or _shipped_weights(self.model.registry)]
        sources += [d.path for d in quant.calibration.datasets if d.arg and d.path.exists()]
        return _hash(
            {
                "registry": self.model.registry,
                "prepare": dataclasses.asdict(self.prepare),
                "quant": dataclasses.asdict(quant),
                "target": self.variant.target,
                "versions": tool_versions(),
                "files": [_fingerprint(s) for s in sources if s is not None],
            }
        )

    def key(self) -> str:
        """The export key, and what evaluation and bench depend on."""
        inputs = {
            "export": self.export_key(),
            "eval": dataclasses.asdict(self.eval) if self.eval else None,
            "bench": dataclasses.asdict(self.bench),
        }
        files = [self.eval.text] if self.eval else []
        if self.images is not None:  # (a text task's key is what it was before image questions)
            from genai_pipeline.evaluate.images import read_questions

            inputs["images"] = dataclasses.asdict(self.images)
            files += [self.images.images, *(q.image for q in read_questions(self.images.images, self.images.limit))]
        inputs["files"] = [_fingerprint(f) for f in files]
        return _hash(inputs)


def tasks_of(spec: Spec) -> list[Task]:
    """Every (model, variant): a vision-language model's tasks take the spec's image questions."""
    return [
        Task(m, v, spec.prepare_for(m, v), spec.eval, spec.bench, spec.images if _kind(m) == VLM else None)
        for m in spec.models
        for v in spec.variants
    ]


TEXT, VLM, SPEECH = "text", "vision-language", "speech"


@functools.cache
def model_kind(model: Model) -> str:
    """TEXT, VLM (an image tower) or SPEECH (an audio tower): its registry entry's, else its
    checkpoint's (a GenAIError where neither can be read)."""
    from genai_pipeline.checkpoints import infer_checkpoint_spec
    from genai_pipeline.registry import get_spec

    spec = get_spec(model.registry) if model.registry else infer_checkpoint_spec(model.checkpoint)[0]
    return VLM if spec.vision is not None else SPEECH if spec.audio is not None else TEXT


def _kind(model: Model) -> str | None:
    try:
        return model_kind(model)
    except GenAIError:
        return None  # its task fails with the line of reading it (run.py)


def check_models(spec: Spec) -> None:
    """SpecError, a line each, where the spec does not fit its models: a text model with no
    eval.text, a vision-language model with no eval.images, a speech model (genai eval and bench do
    not measure one yet), image questions no model answers or that cannot be read, a variant's
    vision_recipe beside a text model. Before any work (a model whose checkpoint cannot be read is
    left to its tasks, which fail with that line)."""
    errors, kinds = [], [_kind(model) for model in spec.models]
    for i, (model, kind) in enumerate(zip(spec.models, kinds)):
        where = f"{spec.source}: models[{i}]"
        if kind == SPEECH:
            errors.append(
                f"{where}: {model.name} is a speech model: genai eval and genai bench measure text and "
                "vision-language exports so far, and so does a sweep"
            )
        if kind == VLM and spec.images is None:
            errors.append(
                f"{where}: {model.name} is a vision-language model: give eval.images, its image questions "
                "(a .jsonl as genai eval --images reads), to evaluate it"
            )
        if kind == TEXT and spec.eval is None:
            errors.append(
                f"{where}: {model.name} is a text model and eval gives image questions only: "
                "give eval.text (the text genai eval --text scores) to evaluate it"
            )
        for j, variant in enumerate(spec.variants):
            if kind == TEXT and variant.quant.vision_recipe is not None:
                errors.append(
                    f"{spec.source}: variants[{j}].vision_recipe: {model.name} is a text model (no image tower): "
                    "sweep vision-language models with such variants in a spec of their own"
                )
    if spec.images is not None and VLM not in kinds and None not in kinds:
        errors.append(
            f"{spec.source}: eval.images: no model of the spec is a vision-language model: "
            "remove the image questions or add such a model"
        )
    elif spec.images is not None and VLM in kinds:
        from genai_pipeline.evaluate.images import read_questions

        try:
            read_questions(spec.images.images, spec.images.limit)
        except InputError as e:
            errors.append(f"{spec.source}: eval.images: {e}")
    if errors:
        raise SpecError("\n".join(errors))


def model_params(model: Model) -> int:
    """The model's parameter count, read from its checkpoint's config (or the registry entry)."""
    from genai_pipeline.checkpoints import infer_checkpoint_spec
    from genai_pipeline.registry import get_spec

    if model.checkpoint is not None:
        spec = infer_checkpoint_spec(model.checkpoint)[0]
    else:
        spec = get_spec(model.registry)
    return spec.config.num_params + (spec.vision.config.num_params if spec.vision else 0)


def export_memory_bytes(model: Model, params: int) -> int:
    """What one export of `model` may hold at its peak, the memory its Ray task declares: 2.5 GB and
    10 bytes a parameter cover the peaks measured (SmolLM2-135M: 2.2 GB fp32, 2.6 GB 8da8w, 3.5 GB
    8da4w with a size budget, docs/sweep.md; Llama-3.2-1B 8da4w: 10.0 GB, docs/decisions/0004)."""
    if model.memory_gb is not None:
        return int(model.memory_gb * 1e9)
    return int(2.5e9 + 10 * params)


def bench_memory_bytes(params: int) -> int:
    """What a bench of the model may hold: the libraries and at most its float weights."""
    return int(1e9 + 4 * params)


def export_stage(task: Task, storage: Path, run_id: str) -> dict:
    """Export (or reuse the export of the same key), then evaluate; the row's figures so far. A
    GenAIError is the task's failure: recorded as {"error": its one line}."""
    folder = task.folder(storage)
    folder.mkdir(parents=True, exist_ok=True)
    _started(folder, "export", run_id)
    try:
        row = _export(task, folder / "export", folder / EXPORT_RECORD)
        row.update(_evaluate(task, folder / "export"))
        return row
    except GenAIError as e:
        return {"error": str(e)}


def bench_stage(task: Task, storage: Path, run_id: str, threads: int = 0) -> dict:
    """`genai bench` of the task's export with the spec's threads, else `threads` (the CPUs the
    stage was given: every core of its node; 0: one per core of this machine, as `genai bench`)."""
    from genai_pipeline.bench import bench, bench_multimodal
    from genai_pipeline.manifest import Manifest
    from genai_pipeline.runtime.multimodal import is_multimodal

    folder = task.folder(storage)
    _started(folder, "bench", run_id)
    options = task.bench if task.bench.threads else dataclasses.replace(task.bench, threads=threads)
    try:
        # as `genai bench` chooses: a vision-language program's bench times its image too
        multimodal = is_multimodal(Manifest.read(folder / "export"))
        result = (bench_multimodal if multimodal else bench)(folder / "export", options)
    except GenAIError as e:
        return {"error": str(e)}
    speeds = ("image_encode_ms", "time_to_first_token_ms") if multimodal else ()
    speeds += ("prefill_tokens_per_s", "decode_tokens_per_s", "peak_rss_mb")
    return {"bench": result, **{key: result[key] for key in speeds}, "machine": machine(options.threads)}


def _export(task: Task, out: Path, record: Path) -> dict:
    from genai_pipeline.export import export
    from genai_pipeline.manifest import Manifest

    key = task.export_key()
    done = json.loads(record.read_text()) if record.is_file() else None
    reused = done is not None and done["key"] == key and (out / "manifest.json").is_file()
    if not reused:
        record.unlink(missing_ok=True)  # an export under way is no longer the recorded one
        export(task.model.registry, out=out, prepare=task.prepare, quant=task.variant.quant, target=task.variant.target)
        record.write_text(json.dumps({"key": key}))
    manifest = Manifest.read(out)
    programs = {name: manifest.files[name].bytes for name in manifest.programs.values()}
    return {
        "exported": not reused,
        "folder": str(out),
        "recipe": manifest.recipe,
        "mode": manifest.mode.value,
        "program_mb": round(sum(programs.values()) / 1e6, 3),
        "files": {name: f.bytes for name, f in manifest.files.items()},
        "export_minutes": round(manifest.export_seconds / 60, 2),
        # the export's process peak (this worker runs one stage: run.py's max_calls=1)
        "export_peak_rss_mb": (manifest.export_stages or {}).get("peak_rss_mb"),
        "verification": dict(manifest.verification) if manifest.verification else None,
    }


def _evaluate(task: Task, out: Path) -> dict:
    """`genai eval --text` where the task has a text, `genai eval --images` where it has image questions."""
    row = _evaluate_text(task.eval, out) if task.eval is not None else {}
    if task.images is not None:
        row.update(_evaluate_images(task.images, out))
    return row


def _evaluate_images(options: ImageEvalOptions, out: Path) -> dict:
    from genai_pipeline.evaluate import evaluate_images

    result = evaluate_images(out, options, progress=False)
    ppl = result["answer_perplexity"]
    return {
        "images": result,
        "exact_match": result["exact_match"]["program"],
        "float_exact_match": result["exact_match"]["float"],
        "answers_agree": result["answers_agree"],
        "answer_perplexity": ppl["program"],
        "answer_perplexity_change_pct": round(100 * (ppl["program"] / ppl["float"] - 1), 3),
    }


def _evaluate_text(options: EvalOptions, out: Path) -> dict:
    from genai_pipeline.evaluate import evaluate

    result = evaluate(out, options, progress=False)
    ppl = result["perplexity"]
    scored = ppl["program"] if ppl["program"] is not None else ppl["qdq"]
    return {
        "eval": result,
        "perplexity": scored,
        "perplexity_change_pct": round(100 * (scored / ppl["float"] - 1), 3),
        "kl_divergence": result["kl_divergence"],
        "top1_agreement": result["top1_agreement"],
    }


def machine(threads: int = 0) -> dict:
    """What the speed figures were measured on: the CPU (its model name, family and model: a VM's
    model name may say only "AMD EPYC"), its widest vector unit, the cores and the threads used."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if not sep and info:
                    break  # the first processor's fields are enough
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = info.get("model name", "unknown CPU")
    if "cpu family" in info:
        cpu += f" (family {info['cpu family']}, model {info.get('model', '?')})"
    flags = info.get("flags", "").split()
    vector = next((v for v in ("amx_tile", "avx512f", "avx2") if v in flags), None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {"cpu": cpu, "vector": vector, "cores": cores, "threads": threads or cores, "host": socket.gethostname()}


def attempts(task: Task, storage: Path, run_id: str, stage: str) -> list[dict]:
    """The workers that started `stage` of `task` in run `run_id`, in order (a retry adds one)."""
    path = task.folder(storage) / WORKERS
    lines = path.read_text().splitlines() if path.is_file() else []
    return [w for w in map(json.loads, lines) if w["run"] == run_id and w["stage"] == stage]


def _started(folder: Path, stage: str, run_id: str) -> None:
    line = {"run": run_id, "stage": stage, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
    with open(folder / WORKERS, "a") as f:
        f.write(json.dumps(line) + "\n")


def _shipped_weights(registry: str | None) -> Path | None:
    from genai_pipeline.registry import get_spec

    return get_spec(registry).checkpoint if registry else None


def _fingerprint(path: Path) -> dict:
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(f): [f.stat().st_size, f.stat().st_mtime_ns] for f in files}


def _hash(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]
