"""An export's stages measured: wall and CPU seconds and the peak resident memory of each, logged
as each ends (at --verbose) and recorded in the manifest (`stages`), which bench/export_scale.py
charts.

`stage(name)` may be opened anywhere in the pipeline; it records only inside `recording()` (the
export opens one) and costs nothing outside. A stage opened again (one per decoder block) adds to
its record; one opened inside another is recorded under it (`report/rotate`). Resident memory is sampled from /proc every 50 ms by a background thread (Linux; where
there is no /proc the peak is the process's so far, from getrusage). A thread misses what a native
call holding the GIL allocates and frees between two samples (a program's load): a stage during
which the process's own record (VmHWM) rose is given that record, so the stage that set the
process's peak always shows it.
"""

from __future__ import annotations

import contextvars
import logging
import os
import resource
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

log = logging.getLogger(__name__)

SAMPLE_SECONDS = 0.05


@dataclass(frozen=True)
class Stage:
    name: str
    seconds: float  # wall
    cpu_seconds: float  # this process, all threads
    peak_rss_mb: float  # the most resident memory seen during the stage

    def as_manifest(self) -> dict:
        return {
            "name": self.name,
            "seconds": round(self.seconds, 2),
            "cpu_seconds": round(self.cpu_seconds, 2),
            "peak_rss_mb": round(self.peak_rss_mb, 1),
        }


class Recording:
    """The stages of one export, in the order they first ran."""

    def __init__(self):
        self.stages: dict[str, Stage] = {}
        self.open: list[str] = []  # the stages open now, outermost first
        self._peak = 0.0  # since the innermost open stage started
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="genai-rss", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self._peak = max(self._peak, rss_mb())

    def add(self, stage: Stage) -> None:
        old = self.stages.get(stage.name)
        if old is not None:
            stage = replace(
                stage,
                seconds=old.seconds + stage.seconds,
                cpu_seconds=old.cpu_seconds + stage.cpu_seconds,
                peak_rss_mb=max(old.peak_rss_mb, stage.peak_rss_mb),
            )
        self.stages[stage.name] = stage

    def as_manifest(self) -> list[dict]:
        return [s.as_manifest() for s in self.stages.values()]


_recording: contextvars.ContextVar[Recording | None] = contextvars.ContextVar("genai_stages", default=None)


@contextmanager
def recording() -> Iterator[Recording]:
    """Record every stage opened inside (in this thread)."""
    rec = Recording()
    token = _recording.set(rec)
    rec._sampler.start()
    try:
        yield rec
    finally:
        rec._stop.set()
        _recording.reset(token)


@contextmanager
def stage(name: str, quiet: bool = False) -> Iterator[None]:
    """Measure what runs inside as stage `name`; `quiet`: not logged as it ends (a stage of each
    decoder block: `logged` tells their sums once)."""
    rec = _recording.get()
    if rec is None:
        yield
        return
    name = "/".join((*rec.open, name))  # inside another stage (the report's rebuild): named under it
    rec.open.append(name.rpartition("/")[2])
    outer_peak = rec._peak
    rec._peak = rss_mb()
    record_before = peak_rss_so_far_mb()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        rec.open.pop()
        peak = max(rec._peak, rss_mb())
        record = peak_rss_so_far_mb()
        if record > record_before:  # a new process record: exact, where sampling can miss a short one
            peak = max(peak, record)
        done = Stage(name, time.perf_counter() - wall, time.process_time() - cpu, peak)
        rec.add(done)
        rec._peak = max(outer_peak, peak)  # an enclosing stage saw this peak too
        if not quiet:
            _log(done)


def logged(names: tuple[str, ...]) -> None:
    """Log the stages `names` as recorded so far (their sums over every block)."""
    rec = _recording.get()
    for name in names:
        name = "/".join((*rec.open, name)) if rec is not None else name
        if rec is not None and name in rec.stages:
            _log(rec.stages[name])


def peak_gb() -> str:
    """The process's peak RSS so far, for a progress bar ('' outside a recording)."""
    return f"{peak_rss_so_far_mb() / 1024:.2f} GB" if _recording.get() is not None else ""


def _log(done: Stage) -> None:
    log.debug(
        "stage %s: %.1f s wall, %.1f s CPU, peak RSS %.2f GB (process peak so far %.2f GB)",
        done.name,
        done.seconds,
        done.cpu_seconds,
        done.peak_rss_mb / 1024,
        peak_rss_so_far_mb() / 1024,
    )


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mb() -> float:
    """This process's resident memory now, in MiB."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except OSError:
        return peak_rss_so_far_mb()


def peak_rss_so_far_mb() -> float:
    """The most resident memory this process has held, in MiB: its memory's high-water mark (Linux's
    VmHWM; getrusage's ru_maxrss would also count what the process that exec'd it held), else
    getrusage's (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024
