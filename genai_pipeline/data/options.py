"""Calibration options: which datasets (`--calib NAME:ARG`, repeatable), how many samples, how long."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from genai_pipeline.errors import DataError, InputError

# kind -> what its ARG is; `random` takes none.
DATASET_KINDS: dict[str, str | None] = {
    "random": None,
    "text": "a UTF-8 text file",
    "messages": "a JSON file of chat samples",
    "hf-chat": "a folder saved by Hugging Face `datasets` (parquet, arrow or jsonl files)",
    "lm-eval": "a task's data cached as JSON lines",
}


def _known() -> str:
    return ", ".join(f"{kind}:ARG" if arg else kind for kind, arg in DATASET_KINDS.items())


@dataclass(frozen=True)
class DatasetSpec:
    kind: str
    arg: str | None = None

    def __post_init__(self):
        if self.kind not in DATASET_KINDS:
            raise DataError(f"unknown calibration dataset '{self.kind}'; known: {_known()}")
        wants = DATASET_KINDS[self.kind]
        if wants is None and self.arg:
            raise DataError(f"'{self.kind}' takes no argument (got '{self.arg}'); set the sample count with --calib-limit")
        if wants is not None and not self.arg:
            raise DataError(f"'{self.kind}' needs {wants}: --calib {self.kind}:PATH")

    @property
    def path(self) -> Path:
        if self.arg is None:
            raise ValueError(f"'{self.kind}' has no path")
        return Path(self.arg)

    def __str__(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind


def parse_dataset(text: str) -> DatasetSpec:
    """`NAME:ARG` (as given to `--calib`) -> DatasetSpec; the ARG is everything after the first ':'."""
    kind, _, arg = text.strip().partition(":")
    return DatasetSpec(kind, arg or None)


@dataclass(frozen=True)
class CalibrationOptions:
    datasets: tuple[DatasetSpec, ...] = ()  # --calib, in order; their samples are concatenated
    limit: int | None = None  # --calib-limit: samples in all (the first ones); `random` makes this many, else 8
    seq_len: int = 128  # --calib-seq-len: tokens per sample; longer samples are truncated

    def __post_init__(self):
        datasets = (self.datasets,) if isinstance(self.datasets, (str, DatasetSpec)) else self.datasets
        specs = tuple(parse_dataset(d) if isinstance(d, str) else d for d in datasets)
        if not all(isinstance(d, DatasetSpec) for d in specs):
            raise TypeError(f"datasets must be DatasetSpec or 'NAME:ARG' strings, got {self.datasets!r}")
        object.__setattr__(self, "datasets", specs)
        if self.limit is not None and self.limit < 1:
            raise InputError(f"--calib-limit must be at least 1, got {self.limit}")
        if self.seq_len < 1:
            raise InputError(f"--calib-seq-len must be at least 1, got {self.seq_len}")
