"""Memory the process holds, given back to the operating system.

glibc's malloc keeps memory that tensors below its mmap threshold (which rises, up to 32 MB, as
large blocks are freed) were freed from, for reuse: after a decoder block is quantized the process
still holds that block's temporaries in its resident set. `trim()` returns them (malloc_trim also
releases free pages inside the heap). Elsewhere (macOS, musl) it does nothing.

`move_to_file()` turns tensors' memory into pages of a memory-mapped file, which the kernel (or
`MADV_PAGEOUT`, upstream/xnnpack_preprocess.py) can drop and read back when needed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
from pathlib import Path


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


def move_to_file(tensors, path: Path) -> int:
    """The storages of `tensors` (plain CPU tensors) copied into a new file at `path`, and each
    tensor pointed at its storage's bytes there, mapped privately (copy on write: the file never
    changes); the file is unlinked at once and its blocks go when the last tensor does. Returns
    the bytes moved. Values, storages and the views between tensors stay as they were (one
    mapping per storage, of its size: ExecuTorch's serializers read a weight's whole storage), but
    their pages are now clean copies of a file, not anonymous memory: a process that has read
    them can give them back (MADV_PAGEOUT) and read them again only if it needs them again. Call
    it before anything makes new tensors of them (views made after see the same bytes)."""
    import numpy as np
    import torch

    offsets, placed = {}, []  # {storage's data_ptr: its offset in the file}, [(tensor, that offset)]
    size = 0
    with open(path, "xb") as f:
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.device.type != "cpu":
                continue
            if storage.data_ptr() not in offsets:
                offsets[storage.data_ptr()] = size
                f.write(memoryview(torch.empty(0, dtype=torch.uint8).set_(storage).numpy()))
                size += storage.nbytes()
                f.write(bytes(-size % mmap.ALLOCATIONGRANULARITY))  # each storage maps from its own page
                size += -size % mmap.ALLOCATIONGRANULARITY
            placed.append((t, offsets[storage.data_ptr()]))
    try:
        mapped = {
            offset: torch.from_numpy(np.memmap(path, np.uint8, "c", offset, (nbytes,))).untyped_storage()
            for offset, nbytes in {o: t.untyped_storage().nbytes() for t, o in placed}.items()
        }
    finally:
        os.unlink(path)
    with torch.no_grad():
        for t, offset in placed:
            t.set_(mapped[offset], t.storage_offset(), t.shape, t.stride())
    return sum(s.nbytes() for s in mapped.values())
