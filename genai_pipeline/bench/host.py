"""What the host gives a benchmark: its memory bandwidth, this process's resident memory now and
at its peak, and the wall time of a call."""

from __future__ import annotations

import os
import resource
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def memory_bandwidth_gbs(megabytes: int = 256, repeats: int = 5) -> float:
    """Best-of-N copy bandwidth (read + write) of a buffer far larger than the caches, all cores
    copying a slice each at once (numpy lets go of the GIL): one core alone reaches about half of
    what the machine can move (14 vs 26 GB/s on the 2-core machine this was written on)."""
    src = np.ones(megabytes * 2**20 // 8)
    dst = np.empty_like(src)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    bounds = np.linspace(0, len(src), cores + 1).astype(int)
    slices = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    with ThreadPoolExecutor(cores) as pool:
        best = min(timed(lambda: list(pool.map(lambda s: np.copyto(dst[s], src[s]), slices))) for _ in range(repeats))
    return 2 * src.nbytes / best / 1e9


def current_rss_mb() -> float:
    """This process's resident memory now (Linux; 0 elsewhere)."""
    return status_mb("VmRSS")


def status_mb(field: str) -> float:
    """A memory figure of /proc/self/status, 0 where there is none. Peak RSS is read there
    (VmHWM), not from getrusage: a process started by vfork + exec (Python's subprocess) inherits
    its parent's peak in ru_maxrss, so a bench started from a 500 MB test process reported 500 MB."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith(f"{field}:")) / 1024
    except (OSError, StopIteration):
        return 0.0


def peak_rss_mb() -> float:
    """This process's peak resident memory so far."""
    return status_mb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
