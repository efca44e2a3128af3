"""Memory the process holds, given back to the operating system.

glibc's malloc keeps memory that tensors below its mmap threshold (which rises, up to 32 MB, as
large blocks are freed) were freed from, for reuse: after a decoder block is quantized the process
still holds that block's temporaries in its resident set. `trim()` returns them (malloc_trim also
releases free pages inside the heap). Elsewhere (macOS, musl) it does nothing.

`move_to_file()` turns tensors' memory into pages of a memory-mapped file, which the kernel can
drop and read back when needed; `page_out()` asks it to drop them now.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import sys
from pathlib import Path

_madvise = ctypes.CDLL(None, use_errno=True).madvise if sys.platform == "linux" else None


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


def _plain(t):
    """The plain tensors `t` is made of: itself, or a tensor subclass's (torchao's int weights:
    their integers, scales and zero points)."""
    import torch

    if type(t) in (torch.Tensor, torch.nn.Parameter):
        yield t
    elif hasattr(t, "__tensor_flatten__"):
        for name in t.__tensor_flatten__()[0]:
            yield from _plain(getattr(t, name))


def _file_mappings() -> list[tuple[int, int]]:
    """[start, end) of every file mapping of the process: the lines of /proc/self/maps with an inode."""
    with open("/proc/self/maps") as maps:
        return [tuple(int(a, 16) for a in f[0].split("-")) for f in map(str.split, maps) if len(f) >= 6 and f[4] != "0"]


def _in_a_file(start: int, end: int, files: list[tuple[int, int]]) -> bool:
    return any(lo <= start and end <= hi for lo, hi in files)


def move_to_file(tensors, path: Path) -> int:
    """The storages of `tensors` (CPU tensors; a tensor subclass's inner ones) copied into a new
    file at `path`, and each tensor pointed at its storage's bytes there, mapped privately (copy on
    write: the file never changes); the file is unlinked at once and its blocks go when the last
    tensor does. Storages already in a file mapping (a checkpoint's, or moved before) stay where
    they are. Returns the bytes moved. Values, storages and the views between tensors stay as they
    were (one mapping per storage, of its size: ExecuTorch's serializers read a weight's whole
    storage), but their pages are now clean copies of a file, not anonymous memory: a process that
    has read them can give them back (page_out) and read them again only if it needs them again.
    Call it before anything makes new tensors of them (views made after see the same bytes)."""
    import numpy as np
    import torch

    offsets, placed = {}, []  # {storage's data_ptr: its offset in the file}, [(tensor, that offset)]
    size, files = 0, _file_mappings()
    with open(path, "xb") as f:
        for t in (p for tensor in tensors for p in _plain(tensor)):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in offsets:
                if storage.nbytes() == 0 or storage.device.type != "cpu" or _in_a_file(key, key + 1, files):
                    continue
                offsets[key] = size
                f.write(memoryview(torch.empty(0, dtype=torch.uint8).set_(storage).numpy()))
                size += storage.nbytes()
                f.write(bytes(-size % mmap.ALLOCATIONGRANULARITY))  # each storage maps from its own page
                size += -size % mmap.ALLOCATIONGRANULARITY
            placed.append((t, offsets[key]))
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


def page_out(tensors) -> None:
    """Hint the kernel to reclaim the pages behind `tensors` that are memory-mapped files (Linux
    MADV_PAGEOUT), for a process that has read them and will not soon again. A float export
    reads its weights from mapped safetensors files, a quantized one from the file `move_to_file`
    moved them to (compile.map_weights_to_file): once XNNPACK has serialized a partition's weights
    (upstream/xnnpack_preprocess.py), their pages are clean copies of the file and can go, to be
    read again only if something reads them again. Anonymous memory is left alone (it would go to
    swap, not away)."""
    if _madvise is None:
        return
    files = _file_mappings()
    page = mmap.PAGESIZE
    for t in (p for tensor in tensors for p in _plain(tensor)):
        if not t.is_contiguous():
            continue
        start = t.data_ptr()  # its own bytes: one mapping may hold many tensors (heap.move_to_file)
        end = start + t.numel() * t.element_size()
        first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor
        if last > first and _in_a_file(first, last, files):
            _madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 21)  # 21: MADV_PAGEOUT
