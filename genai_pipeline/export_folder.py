"""An export folder on disk: the names of its files, atomic writes, staging and publishing, the
checkpoint's fingerprint. Its manifest is manifest.py's; the hand-offs between the stages are in
artifacts.py."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from importlib.metadata import version
from pathlib import Path
from typing import Any, BinaryIO

import torch

from genai_pipeline import __version__
from genai_pipeline.errors import InputError

MANIFEST = "manifest.json"
WEIGHT_FILES = ("*.safetensors", "*.pt", "*.gguf")  # what a checkpoint's fingerprint covers


def atomic_write(path: Path, data: bytes | str | Callable[[BinaryIO], None]) -> None:
    """Write to a temporary file in the same folder, then rename: a reader never sees half a file.
    `data` may be a function that writes to the open file (a program streamed out in pieces)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        # mkstemp makes the file 0600; an export folder is shared or pushed to a device as it is,
        # so its files get what any other new file gets under the user's umask (0644 under 022).
        os.fchmod(fd, 0o666 & ~_umask())
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


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def tool_versions() -> dict[str, str]:
    """The versions an export depends on: in its manifest, and in the key of a reusable QDQ model."""
    return {
        "genai_pipeline": __version__,
        "torch": torch.__version__,
        "executorch": version("executorch"),
        "torchao": version("torchao"),
    }


def check_out_folder(out: Path, checkpoint: Path | None) -> None:
    """Refuse, before any work, an `--out` that an export must not replace: an export replaces its
    folder whole, so `out` may only be absent, empty, or an export of ours holding nothing else.
    Never the checkpoint's folder (or the folder holding a checkpoint file), nor a parent of it."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InputError(
            f"--out '{out}' is a file; pass a folder (created, or replaced once the new export is complete)"
        )
    if checkpoint is not None:
        checkpoint = Path(checkpoint).resolve()
        holder = checkpoint if checkpoint.is_dir() else checkpoint.parent
        where = out.resolve()
        if where == holder or where in holder.parents:
            raise InputError(
                f"--out '{out}' holds the checkpoint {checkpoint}, and an export replaces its --out folder "
                "whole; pass a new folder outside the checkpoint's"
            )
    if not out.is_dir() or not any(out.iterdir()):
        return
    listed = _files_of_our_export(out)
    if listed is None:
        raise InputError(
            f"--out '{out}' is a folder that is not an export of genai (no {MANIFEST} of ours), and an "
            "export replaces its --out folder whole; pass a new or empty folder"
        )
    foreign = sorted(p.name for p in out.iterdir() if p.name not in listed and not _our_hidden_file(p))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise InputError(
            f"--out '{out}' holds files that are not part of its export ({shown}), and an export replaces "
            "its --out folder whole; move them out, or pass another folder"
        )


def _files_of_our_export(folder: Path) -> set[str] | None:
    """The names an export folder's manifest says are its own (the manifest included), or None
    where the folder holds no manifest written by this tool. Read as raw JSON, not through
    manifest.Manifest: an export of ours that this version cannot read (damaged, or of a newer
    schema) is still ours to replace."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    versions, files = (manifest.get("versions"), manifest.get("files")) if isinstance(manifest, dict) else (None, None)
    if not isinstance(versions, dict) or "genai_pipeline" not in versions or not isinstance(files, dict):
        return None
    return {MANIFEST, *files}


def _our_hidden_file(path: Path) -> bool:
    """A hidden file an export writes besides the listed ones: a QDQ model's reuse key."""
    return path.is_file() and path.name.startswith(".") and path.name.endswith(".qdq.key")


def make_staging_folder(out: Path) -> Path:
    """The folder an export into `out` is built in, created: beside `out` (the same file system, so
    publishing is a rename), hidden, named by this process so that concurrent exports do not meet.
    Creating it is the check that `out` can be written, made before any work starts."""
    out = Path(out)
    staging = out.parent / f".{out.name}.staging-{os.getpid()}"
    try:
        staging.mkdir(parents=True)
    except OSError as e:
        raise InputError(
            f"--out '{out}' cannot be written: {e.strerror} (the export is built beside it, in {staging})"
        ) from None
    return staging


def recover_interrupted(out: Path) -> None:
    """Undo what an export into `out` killed outright left behind (its process gone): its staging
    folder is removed, and an earlier export it had set aside (`.out.old-<pid>`, only where no
    atomic exchange exists) goes back to `out` if `out` is missing, else is removed. Every command
    that reads an export folder calls this first; one that cannot write there reads what is there."""
    out = Path(out)
    try:
        leftovers = sorted(out.parent.glob(f".{out.name}.*-*"))
    except OSError:
        return
    for folder in leftovers:
        kind, _, pid = folder.name.rpartition("-")
        if kind not in (f".{out.name}.staging", f".{out.name}.old") or not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            if kind.endswith(".old") and not out.exists():
                folder.rename(out)
            else:
                shutil.rmtree(folder)
        except OSError:
            pass  # a folder this user cannot change: left for one who can


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def publish(staging: Path, out: Path) -> None:
    """Replace `out` by the complete folder `staging` in one step: on Linux the two folders are
    exchanged atomically (renameat2 RENAME_EXCHANGE), so `out` is at every instant the old export
    or the new one, whole; the old one, now at `staging`, is then removed. Where no exchange exists
    (another OS, a file system without it), the old export is renamed aside first: a kill between
    the two renames leaves `out` missing and the old export in `.out.old-<pid>`, which
    `recover_interrupted` puts back."""
    if not out.exists():
        staging.rename(out)
        return
    if _exchange(staging, out):
        shutil.rmtree(staging, ignore_errors=True)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    out.rename(old)
    try:
        staging.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where this system or file system cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def int4_file(folder: Path, artifact_key: str) -> Path:
    """Where an export of an earlier version kept the int4 weights it chose (gptq, a GGUF's), for
    `genai eval`; they now go to the QDQ cache (quantize/qdq_cache.py), outside the folder."""
    return Path(folder) / f"{artifact_key}.int4.pt"


def smoothing_file(folder: Path, artifact_key: str) -> Path:
    """Where an export of an earlier version kept its smoothing factors (see int4_file)."""
    return Path(folder) / f"{artifact_key}.smoothing.pt"


def weights_fingerprint(checkpoint: Path) -> dict:
    """The checkpoint's absolute path and, for each weight file, its size, modification time and
    sha256. Size and mtime let `check_weights` pass unchanged files at the cost of a stat; the
    sha256 (seconds per GB, once per export) settles a file whose mtime moved (a copy, a `touch`)
    and names the weights wherever the folder goes."""
    checkpoint = Path(checkpoint).resolve()
    files = [checkpoint] if checkpoint.is_file() else sorted(p for g in WEIGHT_FILES for p in checkpoint.glob(g))
    return {
        "path": str(checkpoint),
        "files": {
            f.name: {"bytes": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns, "sha256": sha256(f)} for f in files
        },
    }


def check_weights(fingerprint: Mapping[str, Any] | None) -> None:
    """Refuse weights that changed since the export (`fingerprint`: its manifest's `checkpoint`): a
    float model rebuilt from them would not be the one the program was made from. Manifests
    without a fingerprint (random weights, older exports) pass."""
    if not fingerprint:
        return
    folder = Path(fingerprint["path"])
    if not folder.exists():
        raise InputError(
            f"the checkpoint {folder} the export was made from is gone (its float model is rebuilt from it): "
            "put it back there, or re-export"
        )
    now = {p.name: p for p in ([folder] if folder.is_file() else [p for g in WEIGHT_FILES for p in folder.glob(g)])}
    for name, want in fingerprint["files"].items():
        path = now.pop(name, None)
        if path is None:
            raise InputError(f"the checkpoint's weight file {folder / name} is gone since the export; re-export")
        stat = path.stat()
        if stat.st_size != want["bytes"] or (stat.st_mtime_ns != want["mtime_ns"] and sha256(path) != want["sha256"]):
            raise InputError(f"the checkpoint's weight file {path} changed since the export; re-export")
    if now:
        raise InputError(
            f"the checkpoint has a weight file the export did not read, {next(iter(now.values()))}; re-export"
        )


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
