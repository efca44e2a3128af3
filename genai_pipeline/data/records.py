"""Records of a JSON file (one array) or a JSON-lines file, each with where it is, for errors.

`datasets.Dataset.to_json` writes JSON lines whatever the file is called, so the form is read from
the content: a file whose first character is '[' is one array, anything else is one object a line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from genai_pipeline.errors import DataError
from genai_pipeline.limits import read_input_text


def read_text(path: Path) -> str:
    return read_input_text(path, "calibration data", DataError)


def parse_json(text: str, where: str):
    """JSON from an input file, one DataError for whatever is wrong with it (nesting too deep included)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    except RecursionError:
        raise DataError(f"{where} nests JSON too deeply to read; samples are a few levels deep") from None


def _array(path: Path, text: str) -> list:
    return parse_json(text, f"'{path}'")


def _is_one_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (json.JSONDecodeError, RecursionError):
        return False


def json_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) for each record of `path`; `where` reads '<path> sample 3' or '<path> line 4'."""
    text = read_text(path)
    if text.lstrip().startswith("["):
        for i, record in enumerate(_array(path, text)):
            yield f"'{path}' sample {i}", record
        return
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if _is_one_object(text):
                raise DataError(
                    f"'{path}' holds one JSON object; expected an array of samples or one sample per line"
                ) from None
            raise DataError(f"'{path}' line {n} is not valid JSON: {e.msg} at column {e.colno}") from None
        except RecursionError:
            raise DataError(f"'{path}' line {n} nests JSON too deeply to read; samples are a few levels deep") from None
        yield f"'{path}' line {n}", record
