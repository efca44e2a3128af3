"""ExecuTorch's C++ runtime logs, kept off the terminal.

Upstream: the runtime logs to file descriptor 2 from C++ (`cpuinfo_utils` probing the CPU when a
method loads, `No temp allocator provided`, ...), lines a user cannot act on and that Python's
logging never sees; the executorch 1.5.1 wheel has no setting for its log level.
What we change: while the runtime works, fd 2 points at /dev/null (unless GENAI_DEBUG is set).
Why: `genai run` / `bench` / `eval` print only what a user can act on.
What breaks if upstream changes: nothing is patched, so nothing breaks; a version with a log-level
setting would make this redundant. Another version than the pinned one lets the logs through (a
warning says so once), and tests/upstream/test_executorch_logs.py fails when the pinned wheel grows
a log-level setting or stops logging to fd 2.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from genai_pipeline.upstream import pins

log = logging.getLogger(__name__)


# Runtime calls under way in any thread that hide the logs: fd 2 is pointed at /dev/null by the
# first and back by the last (`genai serve` runs sessions in several threads at once; a save and
# restore per call would race, and one thread could leave fd 2 at /dev/null for good).
_lock = threading.Lock()
_hiding = 0
_saved_fd: int | None = None


def _wanted() -> bool:
    return not os.environ.get("GENAI_DEBUG") and pins.warn_unpinned(log, "ExecuTorch's C++ logs left on", "executorch")


def _hide() -> None:
    global _hiding, _saved_fd
    with _lock:
        if _hiding == 0:
            sys.stderr.flush()
            _saved_fd = os.dup(2)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)
        _hiding += 1


def _show() -> None:
    global _hiding, _saved_fd
    with _lock:
        _hiding -= 1
        if _hiding == 0:
            os.dup2(_saved_fd, 2)
            os.close(_saved_fd)
            _saved_fd = None


@contextmanager
def native_logs_hidden():
    """ExecuTorch's C++ runtime logs to file descriptor 2 (`cpuinfo_utils` probing the CPU when a
    method loads, `No temp allocator provided`, ...): lines a user cannot act on, which Python's
    logging never sees. The 1.5.1 wheel has no log-level setting, so fd 2 points at /dev/null while
    the runtime works, unless GENAI_DEBUG is set. Wrap only runtime calls: nothing of ours is
    printed meanwhile (Python's own messages go through sys.stderr, flushed first)."""
    if not _wanted():
        yield
        return
    _hide()
    try:
        yield
    finally:
        _show()


@contextmanager
def native_logs_hidden_throughout() -> Iterator[TextIO]:
    """For a process that runs the runtime for long, from several threads (`genai serve`): fd 2
    points at /dev/null throughout, and the stream yielded writes where fd 2 wrote, for the
    process's own messages (its logging handlers are pointed at it). The runtime's calls send their
    logs through Python's `sys.stderr` too, so that stays on fd 2. Under GENAI_DEBUG nothing is
    hidden. The stream stays open after: handlers may go on writing to it."""
    sys.stderr.flush()
    stream = open(os.dup(2), "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")
    hide = _wanted()
    if hide:
        _hide()
    try:
        yield stream
    finally:
        if hide:
            _show()
