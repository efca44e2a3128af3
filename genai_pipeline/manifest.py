"""An export folder's manifest.json, typed: `compile` writes it last, and every command reads it
through `Manifest.read`, the one place that checks its shape (it comes from a folder anyone may
have edited) and the one that says to re-export when it cannot read it.

Schema versions: 1, every manifest without a `schema` key (written before the key existed); 2, the
key added and nothing else changed. A reader takes every version up to its own; a manifest of a
newer one is refused in one line. The sections another stage owns the shape of (the vision
components, the cache-I/O contract, the verification, the backend's compile spec, the special
tokens' sources, the quantization options) stay mappings, as that stage writes them."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genai_pipeline.errors import InputError, ProgramError
from genai_pipeline.export_folder import MANIFEST, atomic_write, recover_interrupted, sha256
from genai_pipeline.manifest_checks import (
    Malformed,
    check_fingerprint,
    checked_audio,
    checked_vision,
    has_contract,
    strings,
    typed_value,
    whole,
)
from genai_pipeline.models.cache_io import FORM
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.names import ArtifactKey, Mode

SCHEMA_VERSION = 2
COMPLETE, QDQ_ONLY = "complete", "qdq-only"  # `status`: programs written, or lowering blocked on the host
SPLIT = "split"  # a vision-language export's `vision.layout` with one program per component


@dataclass(frozen=True)
class FileEntry:
    """A file of the folder as the export wrote it."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class ArtifactEntry:
    """One program of the export: its file (None where lowering was blocked), its methods, and the
    calibrated QDQ model(s) of a static recipe, kept for `genai eval`."""

    file: str | None
    methods: tuple[str, ...]
    dynamic_methods: tuple[str, ...] = ()
    constant_methods: Mapping[str, Any] = field(default_factory=dict)
    qdq: str | Mapping[str, str] | None = None  # a file name; a vision-language program's: {graph: file name}
    # What the export chose that its QDQ model is rebuilt from beside the checkpoint: "int4" (GPTQ's or a
    # GGUF's 4-bit weights), "smoothing" (SmoothQuant's factors); kept in the QDQ cache under the
    # program's sha256, outside the folder (quantize/qdq_cache.py)
    chosen: tuple[str, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """What an export folder holds and how it was made: everything a command reads of it."""

    model: str
    entry: str  # the registry entry whose loader read the checkpoint
    weights: str  # the --checkpoint as typed, or "random"
    config: DecoderConfig
    mode: Mode
    max_seq_len: int
    prefill_len: int
    artifacts: Mapping[ArtifactKey, ArtifactEntry]
    files: Mapping[str, FileEntry]
    family: str | None = None
    # the checkpoint's absolute path and each weight file's size, mtime and sha256 (export_folder.weights_fingerprint)
    checkpoint: Mapping[str, Any] | None = None
    recipe: str = "fp32"
    quantization: Mapping[str, Any] = field(default_factory=dict)  # the QuantOptions applied, as data
    seed: int = 0
    target: str = "xnnpack"
    compile_spec: Mapping[str, Any] | None = None  # the backend's, decoded (QNN)
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    special_tokens: Mapping[str, Any] | None = None  # the ids and the files each came from
    status: str = COMPLETE
    vision: Mapping[str, Any] | None = None  # a vision-language program's components, image size, preprocessing
    audio: Mapping[str, Any] | None = None  # a speech-language program's components, audio preprocessing
    decoder_form: str | None = None  # "cache-io": the KV cache is method I/O, described by `cache_io`
    cache_io: Mapping[str, Any] | None = None
    export_seconds: float | None = None
    versions: Mapping[str, str] = field(default_factory=dict)
    verification: Mapping[str, Any] | None = None  # the closing check's figures (evaluate.verify)
    # each stage's wall and CPU seconds and peak RSS, and the export's peak RSS (stages.py)
    export_stages: Mapping[str, Any] | None = None

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        """The manifest of the export folder `folder`; ProgramError, in one line, where there is
        none or it is not one this version reads."""
        recover_interrupted(folder)
        path = Path(folder) / MANIFEST
        if not Path(folder).is_dir():
            raise ProgramError(f"'{folder}' does not exist or is not a folder; pass the --out folder of `genai export`")
        if not path.is_file():
            raise ProgramError(f"'{folder}' has no {MANIFEST}: it is not a complete export; run `genai export` again")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ProgramError(f"'{path}' is corrupt ({e}); re-export with this version") from None
        return cls.from_json(data, path)

    @classmethod
    def from_json(cls, data: object, source: str | Path = MANIFEST) -> Manifest:
        """The manifest in `data` (parsed JSON); `source` names it in the error."""
        schema = data.get("schema", 1) if isinstance(data, dict) else 1
        if isinstance(schema, int) and not isinstance(schema, bool) and schema > SCHEMA_VERSION:
            raise ProgramError(
                f"'{source}' was written by a newer genai_pipeline (schema {schema}); upgrade, or re-export "
                "with this version"
            )
        try:
            return _parse(data)
        except Malformed as e:
            raise ProgramError(
                f"'{source}' is not a manifest `genai export` writes ({e}); re-export with this version"
            ) from None

    def to_json(self) -> dict:
        """The manifest as JSON data, in the order a reader of the file expects: what the program
        is, how it was made, its artifacts and files, then when and with what."""
        data = {
            "schema": SCHEMA_VERSION,  # a manifest of an earlier schema read is written at this one
            "model": self.model,
            "entry": self.entry,
            "family": self.family,
            "weights": self.weights,
            "checkpoint": self.checkpoint,
            "config": _config_json(self.config),
            "recipe": self.recipe,
            "quantization": self.quantization,
            "seed": self.seed,
            "target": self.target,
            "compile_spec": self.compile_spec,
            "mode": self.mode.value,
            "max_seq_len": self.max_seq_len,
            "prefill_len": self.prefill_len,
            "bos_id": self.bos_id,
            "eos_ids": list(self.eos_ids),
            "special_tokens": self.special_tokens,
            "status": self.status,
            "artifacts": {
                key.value: {
                    "file": a.file,
                    "qdq": a.qdq,
                    "methods": list(a.methods),
                    "dynamic_methods": list(a.dynamic_methods),
                    "constant_methods": a.constant_methods,
                    **({"chosen": list(a.chosen)} if a.chosen else {}),
                }
                for key, a in self.artifacts.items()
            },
            "vision": self.vision,
            "audio": self.audio,
            "decoder_form": self.decoder_form,
            "cache_io": self.cache_io,
            "files": {name: {"bytes": f.bytes, "sha256": f.sha256} for name, f in self.files.items()},
            "export_seconds": self.export_seconds,
            "versions": self.versions,
            "verification": self.verification,
            "export_stages": self.export_stages,
        }
        return {k: v for k, v in data.items() if v is not None or k not in _SECTIONS}

    def refuse_speech(self, folder: Path, command: str) -> None:
        """One line for a command not built for speech exports (they run with `genai run` and `inspect`)."""
        if self.audio is not None:
            raise InputError(
                f"'{folder}' holds a speech model: {command} is built for text and vision-language exports so far; "
                "`genai run --audio` runs it"
            )

    def write(self, folder: Path) -> None:
        """Into `folder`, whole or not at all."""
        atomic_write(Path(folder) / MANIFEST, json.dumps(self.to_json(), indent=2) + "\n")

    def with_file(self, folder: Path, name: str) -> Manifest:
        """This manifest listing one more file of its folder, written after the export (the quantization report)."""
        path = Path(folder) / name
        files = {**self.files, name: FileEntry(path.stat().st_size, sha256(path))}
        return dataclasses.replace(self, files=dict(sorted(files.items())))

    @property
    def programs(self) -> dict[ArtifactKey, str]:
        """The file of each artifact that was lowered."""
        return {key: a.file for key, a in self.artifacts.items() if a.file is not None}

    @property
    def checkpoint_path(self) -> Path:
        """Where the float model is rebuilt from: the fingerprint's absolute path (`weights` is the
        --checkpoint as typed, relative to where the export ran)."""
        return Path(self.checkpoint["path"] if self.checkpoint else self.weights)

    def tokenizer(self, folder: Path):
        """The tokenizer of the export folder `folder`, once its files are the ones exported with the
        program (another model's tokenizer.json dropped beside it would encode to ids the program
        never saw)."""
        from genai_pipeline.tokenizer import Tokenizer

        for name, want in self.files.items():
            path = Path(folder) / name
            if not name.startswith("tokenizer") or not path.is_file():
                continue
            if path.stat().st_size != want.bytes or sha256(path) != want.sha256:
                raise ProgramError(
                    f"'{path}' is not the file exported with the program (its sha256 differs from the "
                    "manifest's); put the exported one back, or re-export"
                )
        return Tokenizer.from_folder(Path(folder), bos_id=self.bos_id)


# The optional sections, left out where an export has none (the other keys are written as null).
# DecoderConfig fields added after schema 2 began: written only where they differ from their
# defaults, so the manifest of a model that uses none reads as before (in older versions too)
_LATER_CONFIG_FIELDS = (
    "pre_norms",
    "conv_layers",
    "conv_kernel",
    "qk_norm_across_heads",
    "embedding_multiplier",
    "residual_multiplier",
    "logit_divisor",
    "mrope_section",
)


def _config_json(config: DecoderConfig) -> dict:
    defaults = {f.name: f.default for f in dataclasses.fields(DecoderConfig)}
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in _LATER_CONFIG_FIELDS or v != defaults[k]}


_SECTIONS = ("compile_spec", "vision", "audio", "decoder_form", "cache_io", "verification", "export_stages")


def _parse(data) -> Manifest:
    if not isinstance(data, dict):
        raise Malformed(f"a JSON {type(data).__name__}, not an object")
    if not whole(data.get("schema", 1), 1):
        raise Malformed(f"schema {json.dumps(data['schema'])[:20]}")
    model, weights = typed_value(data, "model", (str,), True), typed_value(data, "weights", (str,), True)
    config = typed_value(data, "config", (dict,), True)
    mode = typed_value(data, "mode", (str,), True)
    max_seq_len, prefill_len = (
        typed_value(data, "max_seq_len", (int,), True),
        typed_value(data, "prefill_len", (int,), True),
    )
    artifacts, files = typed_value(data, "artifacts", (dict,), True), typed_value(data, "files", (dict,), True)
    if max_seq_len < 1 or prefill_len < 1:
        raise Malformed("a length below 1")
    if mode not in {m.value for m in Mode}:
        raise Malformed(f"mode '{mode[:20]}'")
    config = _decoder_config(config)
    bos_id, eos_ids = data.get("bos_id"), data.get("eos_ids")
    ids = [bos_id, *(eos_ids if isinstance(eos_ids, list) else [None, "x"])]
    if any(i is not None and not (whole(i) and i < config.vocab_size) for i in ids):
        raise Malformed("special token ids that are not ids of its vocabulary")
    status = typed_value(data, "status", (str,)) or COMPLETE
    if status not in (COMPLETE, QDQ_ONLY):
        raise Malformed(f"status '{status[:20]}'")
    vision = checked_vision(typed_value(data, "vision", (dict,)))
    audio = checked_audio(typed_value(data, "audio", (dict,)))
    decoder_form, cache_io = typed_value(data, "decoder_form", (str,)), typed_value(data, "cache_io", (dict,))
    if decoder_form is not None and (decoder_form != FORM or not has_contract(cache_io)):
        raise Malformed(f"decoder_form '{decoder_form[:20]}' without its cache_io contract")
    checkpoint = typed_value(data, "checkpoint", (dict,))
    if checkpoint is not None:
        check_fingerprint(checkpoint)
    listed = {name: _file(name, entry) for name, entry in files.items()}
    return Manifest(
        model=model,
        entry=typed_value(data, "entry", (str,)) or model,
        weights=weights,
        config=config,
        mode=Mode(mode),
        max_seq_len=max_seq_len,
        prefill_len=prefill_len,
        artifacts=_artifacts(artifacts, listed, status, vision, audio),
        files=listed,
        family=typed_value(data, "family", (str,)),
        checkpoint=checkpoint,
        recipe=typed_value(data, "recipe", (str,)) or "fp32",
        quantization=typed_value(data, "quantization", (dict,)) or {},
        seed=typed_value(data, "seed", (int,)) or 0,
        target=typed_value(data, "target", (str,)) or "xnnpack",
        compile_spec=typed_value(data, "compile_spec", (dict,)),
        bos_id=bos_id,
        eos_ids=tuple(eos_ids),
        special_tokens=typed_value(data, "special_tokens", (dict,)),
        status=status,
        vision=vision,
        audio=audio,
        decoder_form=decoder_form,
        cache_io=cache_io,
        export_seconds=typed_value(data, "export_seconds", (int, float)),
        versions=typed_value(data, "versions", (dict,)) or {},
        verification=typed_value(data, "verification", (dict,)),
        export_stages=typed_value(data, "export_stages", (dict,)),
    )


def _decoder_config(config: dict) -> DecoderConfig:
    for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads"):
        if not whole(config.get(key), 1):
            raise Malformed(f"config {key} {json.dumps(config.get(key))[:20]}")
    try:
        return DecoderConfig.from_dict(config)
    except (TypeError, ValueError) as e:
        raise Malformed(f"config: {' '.join(str(e).split())[:60]}") from None


def _file(name: str, entry) -> FileEntry:
    if Path(name).name != name:
        raise Malformed(f"a file outside the folder, '{name[:40]}'")
    if not isinstance(entry, dict) or not whole(entry.get("bytes")) or not isinstance(entry.get("sha256"), str):
        raise Malformed(f"file '{name[:40]}' without its size and sha256")
    return FileEntry(entry["bytes"], entry["sha256"])


def _artifacts(artifacts: dict, files: dict, status: str, vision, audio) -> dict[ArtifactKey, ArtifactEntry]:
    entries = {}
    for key, artifact in artifacts.items():
        if (
            not isinstance(artifact, dict)
            or not strings(artifact.get("methods"))
            or not isinstance(artifact.get("file"), (str, type(None)))
        ):
            raise Malformed(f"artifact '{key[:20]}' has no file name and method list")
        file = artifact["file"]
        if file is not None and Path(file).name != file:
            raise Malformed(f"artifact '{key[:20]}' names a file outside the folder, '{file[:40]}'")
        if file is None if status == COMPLETE else file is not None:
            raise Malformed(f"artifact '{key[:20]}' {'without' if file is None else 'with'} a program, status {status}")
        if file is not None and file not in files:
            raise Malformed(f"artifact '{key[:20]}' names a file the manifest does not list, '{file[:40]}'")
        if key not in {k.value for k in ArtifactKey}:
            raise Malformed(f"an artifact genai does not export, '{key[:20]}'")
        dynamic, constants, qdq = (
            artifact.get("dynamic_methods", []),
            artifact.get("constant_methods", {}),
            artifact.get("qdq"),
        )
        chosen = artifact.get("chosen", [])
        if not strings(dynamic) or not isinstance(constants, dict) or not isinstance(qdq, (str, dict, type(None))):
            raise Malformed(f"artifact '{key[:20]}' has malformed dynamic methods, constants or QDQ files")
        if not strings(chosen) or not set(chosen) <= {"int4", "smoothing"}:
            raise Malformed(f"artifact '{key[:20]}' has a malformed list of chosen values")
        entries[ArtifactKey(key)] = ArtifactEntry(
            file, tuple(artifact["methods"]), tuple(dynamic), constants, qdq, tuple(chosen)
        )
    needed = (
        (ArtifactKey.MULTIMODAL,)
        if audio is not None or vision is not None and vision["layout"] != SPLIT
        else (ArtifactKey.TOKEN_EMBEDDING, ArtifactKey.TEXT_DECODER, ArtifactKey.VISION_ENCODER)
        if vision is not None
        else (ArtifactKey.TEXT_DECODER,)
    )
    missing = [key.value for key in needed if key not in entries]
    if missing:
        raise Malformed(f"no {' and no '.join(missing)} artifact")
    return entries
