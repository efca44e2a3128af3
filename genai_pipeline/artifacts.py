"""What the stages hand each other: a GraphBundle per graph, an Artifact per program, the
PreparedModel that prepare makes and quantize refines, and the ArtifactSet that an export is."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from genai_pipeline.manifest import Manifest
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.names import ArtifactKey, GraphName
from genai_pipeline.options import PrepareOptions
from genai_pipeline.registry import ModelSpec


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
    # the calibrated QDQ model (an ExportedProgram), once quantized statically; a vision-language
    # program's: {graph name: ExportedProgram} of its calibrated graphs (tower, text decoder)
    qdq: Any = None
    qdq_key: str | None = None  # hash of everything its calibration depended on
    # int4 weights chosen by calibration (gptq) or taken from the checkpoint (a GGUF's Q4_0):
    # {linear weight name: (values, scales)}, kept in the QDQ cache (quantize/qdq_cache.py) for `genai eval`
    int4: Any = None
    # smoothing factors folded into the float weights before quantization (quantize.smooth): {site: factors}
    smoothing: Any = None


@dataclass(frozen=True)
class PreparedModel:
    spec: ModelSpec
    config: DecoderConfig
    artifacts: Mapping[ArtifactKey, Artifact]
    options: PrepareOptions
    weights: str  # checkpoint folder, or "random"
    tokenizer_file: Path | None = None
    special_tokens: Any = None  # checkpoints.special_tokens.SpecialTokens: ids and where each came from
    recipe: str = "fp32"  # set by the quantize stage
    quantization: Mapping[str, Any] = field(default_factory=dict)  # the QuantOptions applied, as data
    # The manifest's optional sections, as the stage that owns each writes it (manifest.Manifest):
    vision: Mapping[str, Any] | None = None  # a vision-language model's components, image size, preprocessing
    audio: Mapping[str, Any] | None = None  # a speech-language model's components and audio preprocessing
    decoder_form: str | None = None  # "cache-io": the program takes its KV cache as I/O ...
    cache_io: Mapping[str, Any] | None = None  # ... by this contract
    # checkpoints.block_loader.BlockLoader: the text decoder's weights still in the checkpoint (its
    # module on the meta device until quantize loads it, a block at a time); None: all loaded
    loader: Any = None


@dataclass(frozen=True)
class ArtifactSet:
    folder: Path
    programs: Mapping[ArtifactKey, Path]
    manifest: Manifest
