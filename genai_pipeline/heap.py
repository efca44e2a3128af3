"""Freed memory given back to the operating system.

glibc's malloc keeps memory that tensors below its mmap threshold (which rises, up to 32 MB, as
large blocks are freed) were freed from, for reuse: after a decoder block is quantized the process
still holds that block's temporaries in its resident set. `trim()` returns them (malloc_trim also
releases free pages inside the heap). Elsewhere (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


def trim() -> None:
    trim_fn = _malloc_trim()
    if trim_fn is not None:
        trim_fn(0)
