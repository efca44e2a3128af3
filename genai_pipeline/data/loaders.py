"""The `text` and `messages` datasets: local files read into Samples."""

from __future__ import annotations

import re
from pathlib import Path

from genai_pipeline.data.records import json_records, read_text
from genai_pipeline.errors import DataError
from genai_pipeline.messages import Sample, messages_from_json, nonempty

BLANK_LINES = re.compile(r"\n\s*\n")


def load_text(path: Path, limit: int | None = None) -> list[Sample]:
    """Plain UTF-8 text; a blank line ends a document, and each document is one sample."""
    path = Path(path)
    documents = [d.strip() for d in BLANK_LINES.split(read_text(path))]
    documents = [d for d in documents if d][:limit]
    return nonempty([Sample(text=d, origin=f"'{path}' document {i}") for i, d in enumerate(documents)], f"'{path}'")


def load_messages(path: Path, limit: int | None = None) -> list[Sample]:
    """Hugging Face chat samples: a JSON array (or JSON lines) of {"messages": [{"role", "content"}, ...]}.
    Image parts name files relative to the JSON file."""
    path = Path(path)
    samples = []
    for where, record in json_records(path):
        if limit is not None and len(samples) >= limit:
            break
        if not isinstance(record, dict) or "messages" not in record:
            raise DataError(f"{where}: expected an object with a 'messages' list, got {str(record)[:60]}")
        samples.append(Sample(messages=messages_from_json(record["messages"], where, path.parent), origin=where))
    return nonempty(samples, f"'{path}'")
