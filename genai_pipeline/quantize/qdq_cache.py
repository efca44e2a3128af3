"""quantize, what an export chose that `genai eval` needs to rebuild its QDQ model, kept outside the
export folder: the int4 weights GPTQ chose (or a GGUF's, taken as they are) and the smoothing
factors folded into the float weights. The folder holds what deploys; these are not part of it.

A cache keyed by the program's sha256 (the digest the manifest lists the program under), one file
per program, written whole or not at all: `$GENAI_PIPELINE_CACHE/qdq/<sha256>.pt`, else under
`$XDG_CACHE_HOME/genai-pipeline`, else `~/.cache/genai-pipeline`. Where a folder has moved to a
machine without its entry, `genai eval` quantizes the checkpoint again as the export did and
stores the result here (evaluate/text.py).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from genai_pipeline.export_folder import atomic_write
from genai_pipeline.quantize.weights import packed_int4, unpacked_int4

log = logging.getLogger(__name__)

CACHE_VARIABLE = "GENAI_PIPELINE_CACHE"


@dataclass(frozen=True)
class Chosen:
    """What an export chose for one program: int4 weights by layer weight name (values [out, in],
    scales [out, in // group]) and smoothing factors by activation site; either may be None."""

    int4: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    smoothing: dict[str, torch.Tensor] | None = None


def cache_folder() -> Path:
    """Where the cache lives: $GENAI_PIPELINE_CACHE, else $XDG_CACHE_HOME/genai-pipeline, else
    ~/.cache/genai-pipeline."""
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "genai-pipeline"


def entry_file(program_sha256: str) -> Path:
    return cache_folder() / "qdq" / f"{program_sha256}.pt"


def store(program_sha256: str, chosen: Chosen) -> None:
    """Keep `chosen` under the program's digest (replacing an entry there)."""
    write(entry_file(program_sha256), chosen)


def write(path: Path, chosen: Chosen) -> None:
    """`chosen` in the cache's format at `path`, whole or not at all: an export writes it before its
    program exists (lowering then holds no copy of it), and `keep` files it once the digest is known."""
    data = {"int4": packed_int4(chosen.int4) if chosen.int4 else None, "smoothing": chosen.smoothing or None}
    atomic_write(path, lambda f: torch.save(data, f))


def keep(program_sha256: str, written: Path) -> None:
    """A file `write` made, moved into the cache under the program's digest (replacing an entry there)."""
    dest = entry_file(program_sha256)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    shutil.move(written, partial)  # a rename on one file system, else a copy and a delete
    partial.replace(dest)


def load(program_sha256: str) -> Chosen | None:
    """What is kept under the program's digest; None where nothing is, or what is there cannot be read
    (it is then computed again and replaced)."""
    path = entry_file(program_sha256)
    if not path.is_file():
        return None
    try:
        data = torch.load(path, weights_only=True)
        return Chosen(unpacked_int4(data["int4"], consume=True) if data["int4"] else None, data["smoothing"])
    except Exception as e:  # a damaged entry is a missing one, not an error: it can be computed again
        log.debug("unreadable QDQ cache entry %s: %s", path, e)
        return None
