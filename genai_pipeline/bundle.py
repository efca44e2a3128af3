"""Hand-offs between the stages: GraphBundle, PreparedModel, ArtifactSet and its manifest."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping

from torch import nn

from genai_pipeline.errors import ProgramError
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.names import ArtifactKey, GraphName
from genai_pipeline.registry import ModelSpec

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class GraphBundle:
    """One graph to export: a module, its example inputs and which input dims are dynamic."""

    name: GraphName
    module: nn.Module
    example_inputs: tuple
    dynamic_shapes: Any = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Artifact:
    """The graphs that become the methods of one .pte, plus its constant (metadata) methods."""

    key: ArtifactKey
    module: nn.Module  # the eager module whose parameters and buffers every graph uses
    graphs: Mapping[GraphName, GraphBundle]  # the deploy graphs: methods of the program
    constant_methods: Mapping[str, Any]
    # Calibrated by static quantization (dynamic length, every position's output); its
    # encodings then serve every deploy graph. Never a method of the program.
    quantize_graph: GraphBundle | None = None
    qdq: Any = None  # the calibrated QDQ model (an ExportedProgram), once quantized statically
    qdq_key: str | None = None  # hash of everything its calibration depended on


@dataclass(frozen=True)
class PreparedModel:
    spec: ModelSpec
    config: DecoderConfig
    artifacts: Mapping[ArtifactKey, Artifact]
    options: Any  # PrepareOptions; typed loosely to keep this module free of stage imports
    weights: str  # checkpoint folder, or "random"
    tokenizer_file: Path | None = None
    special_tokens: Any = None  # checkpoints.special_tokens.SpecialTokens: ids and where each came from
    recipe: str = "fp32"  # set by the quantize stage
    quantization: Mapping[str, Any] = field(default_factory=dict)  # the QuantOptions applied, as data
    manifest_extra: Mapping[str, Any] = field(default_factory=dict)  # more manifest keys (a multimodal model's `vision`)


@dataclass(frozen=True)
class ArtifactSet:
    folder: Path
    programs: Mapping[ArtifactKey, Path]
    manifest: Mapping[str, Any]


def atomic_write(path: Path, data: bytes | str | Callable[[BinaryIO], None]) -> None:
    """Write to a temporary file in the same folder, then rename: a reader never sees half a file.
    `data` may be a function that writes to the open file (a program streamed out in pieces)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    if not Path(folder).is_dir():
        raise ProgramError(f"'{folder}' does not exist or is not a folder; pass the --out folder of `genai export`")
    if not path.is_file():
        raise ProgramError(f"'{folder}' has no {MANIFEST}: it is not a complete export; run `genai export` again")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ProgramError(f"'{path}' is corrupt ({e}); run `genai export` again") from None
