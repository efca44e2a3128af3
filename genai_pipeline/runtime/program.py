"""Loading .pte files into the ExecuTorch runtime, with one clear error for a bad file."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

from genai_pipeline.bundle import sha256
from genai_pipeline.errors import ProgramError
from genai_pipeline.upstream.executorch_logs import native_logs_hidden
from genai_pipeline.upstream.executorch_runtime_import import import_executorch_runtime
from genai_pipeline.upstream.executorch_threadpool import set_threadpool_size
from genai_pipeline.upstream.xnnpack_weights_cache import share_packed_weights

# ExecuTorch's flatbuffer file identifier sits at bytes 4..8 of every .pte.
PTE_MAGIC_PREFIX = b"ET"

log = logging.getLogger(__name__)


def check_pte_file(path: Path, expected_bytes: int | None = None, expected_sha256: str | None = None) -> Path:
    """Refuse missing, truncated or non-ExecuTorch files before the runtime sees them."""
    path = Path(path)
    if not path.is_file():
        raise ProgramError(f"'{path}' does not exist; run `genai export` first or pass the right path")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[4:6] != PTE_MAGIC_PREFIX:
        raise ProgramError(f"'{path}' is not an ExecuTorch program (.pte); re-export it")
    if expected_bytes is not None and size != expected_bytes:
        raise ProgramError(
            f"'{path}' is {size} bytes but its manifest says {expected_bytes}: truncated or replaced; re-export it"
        )
    if expected_sha256 is not None and sha256(path) != expected_sha256:
        raise ProgramError(f"'{path}' does not match the sha256 in its manifest: the file is corrupt; re-export it")
    return path


def load_program(path: Path, expected_bytes: int | None = None, expected_sha256: str | None = None):
    """An `executorch.runtime.Program`, with the kernels our programs use registered first."""
    check_pte_file(path, expected_bytes, expected_sha256)
    import_executorch_runtime()
    from executorch.runtime import Runtime

    share_packed_weights()
    try:
        with native_logs_hidden():
            program = Runtime.get().load_program(Path(path))
            # Touch every method's metadata: a damaged flatbuffer fails here, not mid-generation.
            for name in program.method_names:
                program.metadata(name)
    except (RuntimeError, ValueError) as e:
        raise ProgramError(
            f"'{path}' cannot be loaded by the ExecuTorch runtime ({e}); it is corrupt or truncated, re-export it"
        ) from None
    return program


def set_threads(n: int) -> None:
    """ExecuTorch's threadpool size (XNNPACK's and the custom kernels' threads) for this process."""
    set_threadpool_size(n)


def qnn_runtime_missing() -> str | None:
    """Why a QNN program cannot run on this host (the QNN runtime libraries are absent), or None."""
    try:
        ctypes.CDLL("libQnnHtp.so")
        return None
    except OSError:
        return (
            "this program runs on Qualcomm's HTP (QNN delegate) and the QNN runtime libraries (libQnnHtp.so) "
            "are not on this host's library path; run it on a Snapdragon device, or with the QNN SDK's "
            "x86 libraries on LD_LIBRARY_PATH for an export made with --qnn-x86-emulator"
        )
