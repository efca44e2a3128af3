"""The session for any text export folder: a program's own KV cache (DecoderSession), or the
cache-I/O form that a device runner drives (CacheIOSession)."""

from __future__ import annotations

from pathlib import Path

from genai_pipeline.manifest import Manifest
from genai_pipeline.names import ArtifactKey, GraphName
from genai_pipeline.runtime.cache_io import CacheIOContract, CacheIOSession, program_runner
from genai_pipeline.runtime.program import load_program
from genai_pipeline.runtime.session import DecoderSession, check_constants, check_runnable
from genai_pipeline.upstream.executorch_logs import native_logs_hidden


def open_session(folder: Path, verify: bool = False):
    """The session of a text-decoder export: a DecoderSession, or for a program in the cache-I/O
    form (QNN's; the manifest's `decoder_form`) a CacheIOSession driving its methods, which owns
    the KV cache and builds positions and masks as a device runner does."""
    folder = Path(folder)
    manifest = Manifest.read(folder)
    contract = CacheIOContract.from_manifest(manifest)
    if contract is None:
        return DecoderSession(folder, verify)
    program = load_decoder_program(folder, manifest, verify)
    with native_logs_hidden():
        methods = {GraphName(m): program.load_method(m) for m in contract.tokens_per_call}
    return CacheIOSession(contract, program_runner(methods), manifest)


def load_decoder_program(folder: Path, manifest: Manifest, verify: bool):
    check_runnable(folder, manifest)
    entry = manifest.artifacts[ArtifactKey.TEXT_DECODER]
    expected = manifest.files[entry.file]
    program = load_program(folder / entry.file, expected.bytes, expected.sha256 if verify else None)
    check_constants(program, folder / entry.file, manifest)
    return program
