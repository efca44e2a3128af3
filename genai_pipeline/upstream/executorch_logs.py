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
from contextlib import contextmanager

from genai_pipeline.upstream import pins

log = logging.getLogger(__name__)


@contextmanager
def native_logs_hidden():
    """ExecuTorch's C++ runtime logs to file descriptor 2 (`cpuinfo_utils` probing the CPU when a
    method loads, `No temp allocator provided`, ...): lines a user cannot act on, which Python's
    logging never sees. The 1.5.1 wheel has no log-level setting, so fd 2 points at /dev/null while
    the runtime works, unless GENAI_DEBUG is set. Wrap only runtime calls: nothing of ours is
    printed meanwhile (Python's own messages go through sys.stderr, flushed first)."""
    if os.environ.get("GENAI_DEBUG") or not pins.warn_unpinned(log, "ExecuTorch's C++ logs left on", "executorch"):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
