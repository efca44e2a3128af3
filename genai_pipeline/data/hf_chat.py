"""The `hf-chat` dataset: a chat or text dataset saved locally in Hugging Face `datasets` form.

DIR is what `Dataset.save_to_disk(DIR)` writes (`data-*.arrow`, Arrow IPC streams), a snapshot of a
Hub dataset repository (`**/*.parquet`), or `*.jsonl` files (`Dataset.to_json`); every such file
under DIR is read in name order. A `DatasetDict` folder holds one sub-folder per split: name the
split (`hf-chat:DIR/train`). Each row gives one sample from its `messages` column (a list of
{"role", "content"}; image parts name files relative to the data file) or, without one, from its
`text` column (blank texts are skipped). Parquet and Arrow are read with `pyarrow`, one record batch
at a time, so `--calib-limit` stops the reading early.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from genai_pipeline.data.records import json_records
from genai_pipeline.errors import DataError
from genai_pipeline.messages import Sample, messages_from_json, nonempty

SUFFIXES = (".parquet", ".arrow", ".jsonl")
COLUMNS = ("messages", "text")


def data_files(folder: Path) -> list[Path]:
    folder = Path(folder)
    if folder.is_file() and folder.suffix in SUFFIXES:
        return [folder]
    if not folder.is_dir():
        raise DataError(
            f"hf-chat dataset '{folder}' does not exist or is not a folder; pass the folder given to save_to_disk"
        )
    splits = folder / "dataset_dict.json"
    if splits.is_file():
        try:
            names = json.loads(splits.read_text()).get("splits", [])
        except (json.JSONDecodeError, AttributeError):
            names = []
        example = f"hf-chat:{folder / names[0]}" if names else f"hf-chat:{folder}/SPLIT"
        raise DataError(f"'{folder}' holds the splits {', '.join(names) or '(unreadable)'}; name one, e.g. {example}")
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.suffix in SUFFIXES and p.is_file() and not any(s.startswith(".") for s in p.relative_to(folder).parts)
    )
    if not files:
        raise DataError(
            f"'{folder}' holds no {', '.join('*' + s for s in SUFFIXES)} files; save the dataset with save_to_disk or to_json"
        )
    return files


def _column(path: Path, names: list[str]) -> str:
    column = next((c for c in COLUMNS if c in names), None)
    if column is None:
        raise DataError(f"'{path}' has no 'messages' or 'text' column (columns: {', '.join(names) or 'none'})")
    return column


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError("reading parquet or arrow files needs pyarrow: pip install pyarrow") from None
    return pyarrow


def _arrow_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(column, value) of each row of a parquet or Arrow IPC (stream or file) table."""
    pa = _pyarrow()
    try:
        if path.suffix == ".parquet":
            table = pa.parquet.ParquetFile(str(path))
            column = _column(path, table.schema_arrow.names)
            batches = table.iter_batches(columns=[column], batch_size=256)
        else:
            source = pa.memory_map(str(path))
            try:
                reader = pa.ipc.open_stream(source)  # what `datasets` writes
                batches = iter(reader)
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            column = _column(path, reader.schema.names)
        for batch in batches:
            for value in batch.column(column).to_pylist():
                yield column, value
    except (pa.ArrowException, OSError) as e:
        kind = "parquet" if path.suffix == ".parquet" else "Arrow"
        raise DataError(f"cannot read '{path}' as {kind}: {e}") from None


def _rows(path: Path) -> Iterator[tuple[str, str, Any]]:
    """(where, column, value) for each row of one data file."""
    if path.suffix == ".jsonl":
        for where, record in json_records(path):
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected an object with a 'messages' or 'text' field")
            column = _column(path, list(record))
            yield where, column, record[column]
        return
    for i, (column, value) in enumerate(_arrow_rows(path)):
        yield f"'{path}' row {i}", column, value


def load_hf_chat(folder: Path, limit: int | None = None) -> list[Sample]:
    samples = []
    for path in data_files(folder):
        for where, column, value in _rows(path):
            if limit is not None and len(samples) >= limit:
                return samples
            if column == "messages":
                samples.append(Sample(messages=messages_from_json(value, where, path.parent), origin=where))
            elif not isinstance(value, str) and value is not None:
                raise DataError(f"{where}: 'text' must be a string, got {type(value).__name__}")
            elif value and value.strip():
                samples.append(Sample(text=value, origin=where))
    return nonempty(samples, f"'{folder}'")
