"""The sweep's spec: a YAML file read into frozen dataclasses, torch-free (`genai sweep --help` and a
spec's errors answer at once). Every error is one line naming the file and the key; all of a spec's
errors are told together, so a user fixes them in one pass. SPEC_EXAMPLE shows the format;
docs/sweep.md describes every key.

Whether the spec fits its models (eval.text for a text model, eval.images for a vision-language
one, a variant's vision_recipe for vision-language models only, no speech model) depends on what
their checkpoints hold: tasks.check_models tells that, still before any work, once they are read.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from genai_pipeline.errors import GenAIError, InputError
from genai_pipeline.options import (
    BenchOptions,
    CalibrationOptions,
    EvalOptions,
    ImageEvalOptions,
    PrepareOptions,
    QuantOptions,
    parse_override,
)

SPEC_EXAMPLE = """\
models:                                   # each exported once per variant
  - name: smollm2                         # the report's name for it
    checkpoint: SmolLM2-135M-Instruct.Q4_1.gguf   # relative to the spec: HF folder, llama2.c folder or GGUF
  - registry: reference                   # or a registry entry (genai models) with its shipped weights
  - registry: reference-vlm               # a vision-language model: answers eval.images' questions
variants:                                 # genai export's recipe flags, and target / mode
  - {name: fp32, recipe: fp32}
  - {name: 8da4w, recipe: 8da4w}
  - {name: 8da4w-80MB, recipe: 8da4w, size_budget: 80}
  - {name: q8-head, recipe: 8da4w, overrides: ["output=8da8w"], group_size: 64}
export: {mode: kv, max_seq_len: 512}     # every export's options (genai export's flags)
eval: {text: heldout.txt, max_tokens: 2048, images: questions.jsonl}   # genai eval --text / --images
bench: {prompt_len: 128, gen_len: 64, repeats: 3}     # genai bench
report: {max_perplexity_change: 5, size_classes_mb: [100, 200]}
"""

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
SECTIONS = ("models", "variants", "export", "eval", "bench", "report")
# A variant's keys: the target, the mode (over export.mode) and genai export's quantization flags.
VARIANT_KEYS = (
    "name",
    "recipe",
    "target",
    "mode",
    "group_size",
    "embedding",
    "overrides",
    "size_budget",
    "block_size",
    "vision_recipe",
    "calib",
    "calib_limit",
    "calib_seq_len",
)
EXPORT_KEYS = ("mode", "max_seq_len", "prefill_len", "long_prefill_len", "verify_len", "seed", "cache_io")
TEXT_EVAL_KEYS = ("text", "max_tokens", "window")  # genai eval --text's
IMAGE_EVAL_KEYS = ("images", "limit")  # genai eval --images'
EVAL_KEYS = TEXT_EVAL_KEYS + IMAGE_EVAL_KEYS
BENCH_KEYS = ("prompt_len", "gen_len", "repeats", "threads")


@dataclass(frozen=True)
class Model:
    name: str
    registry: str | None = None  # a registry entry; None: inferred from the checkpoint
    checkpoint: Path | None = None  # None: the registry entry's shipped weights
    memory_gb: float | None = None  # what one export of it may take; None: estimated from its parameters


@dataclass(frozen=True)
class Variant:
    name: str
    quant: QuantOptions
    target: str = "xnnpack"
    mode: str | None = None  # None: the spec's export.mode


@dataclass(frozen=True)
class Report:
    max_perplexity_change: float = 5.0  # % over float: the recommendation's tolerance
    size_classes_mb: tuple[float, ...] = ()  # a recommendation line per class; (): 1-2-5 steps over the rows' sizes


@dataclass(frozen=True)
class Spec:
    source: Path
    models: tuple[Model, ...]
    variants: tuple[Variant, ...]
    prepare: PrepareOptions
    eval: EvalOptions | None  # None: no text to score (every model is a vision-language one)
    bench: BenchOptions
    report: Report = Report()
    images: ImageEvalOptions | None = None  # the image questions of the vision-language models

    def prepare_for(self, model: Model, variant: Variant) -> PrepareOptions:
        mode = variant.mode or self.prepare.mode
        return dataclasses.replace(self.prepare, mode=mode, checkpoint=model.checkpoint)


class SpecError(InputError):
    """A spec with errors: one line each."""


def read_spec(path: str | Path) -> Spec:
    """The spec at `path`; SpecError listing every error found, one a line."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise InputError(f"sweep spec '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise InputError(f"{path}: not YAML{line}: {getattr(e, 'problem', None) or e}") from None
    return parse_spec(data, path)


def parse_spec(data: Any, source: Path) -> Spec:
    errors: list[str] = []

    def error(where: str, what: str) -> None:
        errors.append(f"{source}: {where}: {what}")

    if not isinstance(data, dict):
        raise SpecError(f"{source}: a sweep spec is a mapping of {', '.join(SECTIONS)} (docs/sweep.md)")
    for key in data:
        if key not in SECTIONS:
            error(str(key), f"unknown section; known: {', '.join(SECTIONS)}")
    base = source.parent
    models = _list(data, "models", error, _model, base)
    variants = _list(data, "variants", error, _variant, base)
    for what, items in (("models", models), ("variants", variants)):
        names = [i.name for i in items]
        for name in sorted({n for n in names if names.count(n) > 1}):
            error(what, f"the name '{name}' is given twice; names must differ")
    prepare = _options(data.get("export", {}), "export", PrepareOptions, EXPORT_KEYS, error, base)
    evaluation, images = _evaluations(data.get("eval"), error, base)
    bench = _options(data.get("bench", {}), "bench", BenchOptions, BENCH_KEYS, error, base)
    report = _options(data.get("report", {}), "report", Report, ("max_perplexity_change", "size_classes_mb"), error)
    if errors:
        raise SpecError("\n".join(errors))
    return Spec(source, tuple(models), tuple(variants), prepare, evaluation, bench, report, images)


def _evaluations(section, error, base: Path) -> tuple[EvalOptions | None, ImageEvalOptions | None]:
    """eval's text options (genai eval --text) and image options (genai eval --images), either one
    None where its file is not given; at least one of the files is."""
    if section is not None and not isinstance(section, dict):
        return _options(section, "eval", EvalOptions, EVAL_KEYS, error), None  # its one line
    if not section or ("text" not in section and "images" not in section):
        error("eval", "required: `text: FILE` (genai eval --text), `images: FILE.jsonl` (genai eval --images), or both")
        return None, None
    for key in section:
        if key not in EVAL_KEYS:
            error(f"eval.{key}", f"unknown key; known: {', '.join(EVAL_KEYS)}")
    parts = []
    for cls, keys in ((EvalOptions, TEXT_EVAL_KEYS), (ImageEvalOptions, IMAGE_EVAL_KEYS)):
        given = {k: v for k, v in section.items() if k in keys}
        if given and keys[0] not in given:
            error(f"eval.{next(iter(given))}", f"goes with `{keys[0]}: FILE`, which is not given")
        parts.append(_options(given, "eval", cls, keys, error, base, paths=keys[:1]) if keys[0] in given else None)
    return parts[0], parts[1]


def _list(data: dict, section: str, error, parse, base: Path) -> list:
    items = data.get(section)
    if not isinstance(items, list) or not items:
        error(section, "give a list of at least one entry")
        return []
    parsed = []
    for i, item in enumerate(items):
        where = f"{section}[{i}]"
        if not isinstance(item, dict):
            error(where, "each entry is a mapping of keys (docs/sweep.md)")
            continue
        value = parse(item, where, error, base)
        if value is not None:
            parsed.append(value)
    return parsed


def _model(item: dict, where: str, error, base: Path) -> Model | None:
    for key in item:
        if key not in ("name", "registry", "checkpoint", "memory_gb"):
            error(f"{where}.{key}", "unknown key; known: name, registry, checkpoint, memory_gb")
            return None
    if "registry" not in item and "checkpoint" not in item:
        error(
            where,
            "give `checkpoint: PATH` (a Hugging Face folder, llama2.c folder or GGUF file), `registry: NAME`, or both",
        )
        return None
    checkpoint = None
    if "checkpoint" in item:
        checkpoint = (base / str(item["checkpoint"])).resolve()
        if not checkpoint.exists():
            error(f"{where}.checkpoint", f"'{checkpoint}' does not exist")
            return None
    name = str(item.get("name") or item.get("registry") or checkpoint.stem)
    if not NAME.fullmatch(name):
        error(f"{where}.name", f"'{name}' is not a name: letters, digits, '.', '_' and '-' only (it names folders)")
        return None
    memory = item.get("memory_gb")
    if memory is not None and (not isinstance(memory, (int, float)) or memory <= 0):
        error(f"{where}.memory_gb", f"a size in GB above 0, got {memory!r}")
        return None
    return Model(name, item.get("registry"), checkpoint, memory)


def _variant(item: dict, where: str, error, base: Path) -> Variant | None:
    for key in item:
        if key not in VARIANT_KEYS:
            error(f"{where}.{key}", f"unknown key; known: {', '.join(VARIANT_KEYS)}")
            return None
    name = str(item.get("name", ""))
    if not NAME.fullmatch(name):
        error(f"{where}.name", f"'{name}' is not a name: letters, digits, '.', '_' and '-' only (it names folders)")
        return None
    quant = {
        k: item[k]
        for k in ("recipe", "group_size", "embedding", "size_budget", "block_size", "vision_recipe")
        if k in item
    }
    try:
        overrides = item.get("overrides", [])
        quant["overrides"] = tuple(parse_override(str(o)) for o in _strings(overrides, "overrides"))
        calib = [_calibration_path(str(c), base) for c in _strings(item.get("calib", []), "calib")]
        calibration = {"datasets": tuple(calib)}
        calibration.update({k: item[f"calib_{k}"] for k in ("limit", "seq_len") if f"calib_{k}" in item})
        quant["calibration"] = CalibrationOptions(**_typed(calibration, CalibrationOptions))
        options = QuantOptions(**_typed(quant, QuantOptions))
        mode = item.get("mode")
        if mode is not None:
            PrepareOptions(mode=mode)  # a known mode
    except (GenAIError, TypeError) as e:
        error(where, str(e))
        return None
    return Variant(name, options, str(item.get("target", "xnnpack")), mode)


def _calibration_path(text: str, base: Path) -> str:
    """`NAME:PATH` with PATH relative to the spec's folder."""
    kind, sep, arg = text.partition(":")
    return f"{kind}:{(base / arg).resolve()}" if sep and arg else text


def _strings(value, key: str) -> list:
    if not isinstance(value, list):
        raise InputError(f"{key}: a list, got {value!r}")
    return value


def _options(section, name: str, cls, keys: tuple[str, ...], error, base: Path | None = None, paths: tuple = ()):
    if section is None:
        error(name, f"required: give {', '.join(keys)} (docs/sweep.md)")
        return None
    if not isinstance(section, dict):
        error(name, f"a mapping of {', '.join(keys)}, got {section!r}")
        return None
    values = {}
    for key, value in section.items():
        if key not in keys:
            error(f"{name}.{key}", f"unknown key; known: {', '.join(keys)}")
        else:
            values[key] = (base / str(value)).resolve() if key in paths else value
    try:
        return cls(**_typed(values, cls))
    except (GenAIError, TypeError) as e:
        error(name, str(e))
        return None


def _typed(values: dict, cls) -> dict:
    """`values` checked against the types of `cls`'s defaults (a YAML number where a number is due);
    lists become tuples, as the frozen option classes hold them."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    out = {}
    for key, value in values.items():
        default = defaults.get(key)
        if isinstance(default, bool) and not isinstance(value, bool):
            raise InputError(f"{key}: true or false, got {value!r}")
        if isinstance(default, (int, float)) and not isinstance(default, bool):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputError(f"{key}: a number, got {value!r}")
            if isinstance(default, int) and not isinstance(value, int):
                raise InputError(f"{key}: a whole number, got {value!r}")
        out[key] = tuple(value) if isinstance(value, list) else value
    return out
