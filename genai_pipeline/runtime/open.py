"""The session of any export folder, chosen from its manifest, so that no caller chooses: a
vision-language export's (MultimodalSession), a program in the cache-I/O form's (CacheIOSession),
or a text program's own KV cache (DecoderSession)."""

from __future__ import annotations

from pathlib import Path

from genai_pipeline.manifest import Manifest
from genai_pipeline.models.cache_io import CacheIOContract
from genai_pipeline.names import ArtifactKey, GraphName, method_names
from genai_pipeline.runtime.cache_io import CacheIOSession, program_runner
from genai_pipeline.runtime.multimodal import MultimodalSession, is_multimodal
from genai_pipeline.runtime.program import load_program
from genai_pipeline.runtime.session import DecoderSession, Session, check_constants, check_runnable
from genai_pipeline.upstream.executorch_logs import native_logs_hidden


def open_session(folder: Path, verify: bool = False) -> Session:
    """The session of the export in `folder`; `verify`: check every program's sha256 first. For a
    program in the cache-I/O form (QNN's; the manifest's `decoder_form`) a CacheIOSession drives
    its methods: it owns the KV cache and builds positions and masks as a device runner does."""
    folder = Path(folder)
    manifest = Manifest.read(folder)
    if is_multimodal(manifest):
        return MultimodalSession(folder, verify)
    contract = CacheIOContract.from_manifest(manifest)
    if contract is None:
        return DecoderSession(folder, verify)
    program = load_decoder_program(folder, manifest, verify)
    names = method_names(program.method_names)
    with native_logs_hidden():
        methods = {GraphName(m): program.load_method(names[GraphName(m)]) for m in contract.tokens_per_call}
    return CacheIOSession(contract, program_runner(methods), manifest)


def load_decoder_program(folder: Path, manifest: Manifest, verify: bool):
    check_runnable(folder, manifest)
    entry = manifest.artifacts[ArtifactKey.TEXT_DECODER]
    expected = manifest.files[entry.file]
    program = load_program(folder / entry.file, expected.bytes, expected.sha256 if verify else None)
    check_constants(program, folder / entry.file, manifest)
    return program
