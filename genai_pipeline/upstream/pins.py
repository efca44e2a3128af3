"""The versions of torch, ExecuTorch, torchao and gguf that every module of genai_pipeline/upstream/
was checked against (pyproject.toml pins the same ones), and the one check those modules call.

A module here patches, forks or reads the internals of one of these packages. On the pinned
version it does what its docstring says; on any other it either falls back to upstream's own
behaviour (`pinned`, with `warn_unpinned` saying so once) or stops with one line naming the pinned
version (`require_pinned`). tests/upstream/ fails when a pinned wheel stops behaving as assumed.

Imports nothing but the standard library and `errors`: the runtime-only import path uses it.
"""

from __future__ import annotations

import functools
import logging
from importlib.metadata import PackageNotFoundError, version

from genai_pipeline.errors import ExportError

PINNED_TORCH = "2.13.0"
PINNED_EXECUTORCH = "1.5.1"
PINNED_TORCHAO = "0.18.0"
PINNED_GGUF = "0.19.0"

PINNED = {"torch": PINNED_TORCH, "executorch": PINNED_EXECUTORCH, "torchao": PINNED_TORCHAO, "gguf": PINNED_GGUF}


@functools.cache
def installed(package: str) -> str | None:
    """The installed version of `package` without its local suffix ("2.13.0+cpu" -> "2.13.0"), or
    None when it is not installed. Read from the package's metadata: nothing is imported."""
    try:
        return version(package).split("+")[0]
    except PackageNotFoundError:
        return None


def pinned(*packages: str) -> bool:
    """True when each of `packages` (torch, executorch, torchao, gguf) is installed at its pinned version."""
    return all(installed(p) == PINNED[p] for p in packages)


def unpinned(*packages: str) -> str:
    """ "executorch 1.6.0 (pinned: 1.5.1)" for each of `packages` not at its pinned version."""
    return ", ".join(f"{p} {installed(p) or 'not installed'} (pinned: {PINNED[p]})" for p in packages if not pinned(p))


@functools.cache
def warn_unpinned(log: logging.Logger, what: str, *packages: str) -> bool:
    """True when `packages` are at their pinned versions; otherwise logs once on `log` that `what`
    (upstream's behaviour is kept instead) and returns False."""
    if pinned(*packages):
        return True
    log.warning("%s: %s", what, unpinned(*packages))
    return False


def require_pinned(what: str, *packages: str) -> None:
    """Raises ExportError, one line naming the pinned versions, unless `packages` are at them: for a
    patch with no upstream behaviour to fall back to."""
    if not pinned(*packages):
        wanted = ", ".join(f"{p}=={PINNED[p]}" for p in packages)
        found = ", ".join(f"{p} {installed(p) or 'not installed'}" for p in packages if not pinned(p))
        raise ExportError(f"{what} is written for {wanted}, found {found}: install the versions pyproject.toml pins")
