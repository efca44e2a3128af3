"""A .pte's flatbuffer read without its weights: `genai inspect`, `genai bench` and the weight-sharing
checks look inside programs of any size.

ExecuTorch's public deserializer reads the whole file and copies every segment (three times the
file in memory for a 1B model). Its private `exir._serialize._program` has the two pieces needed to
parse only the flatbuffer, a few kilobytes: `_get_extended_header` (where the segments start) and
`_flatbuffer_to_program`. Here they are used and the segments read by range on demand. On another
ExecuTorch the names may have moved: one line naming the pinned version instead of a traceback.
tests/upstream/test_executorch_pte_reader.py fails when the pinned wheel stops providing them.
"""

from __future__ import annotations

import logging
from pathlib import Path

from genai_pipeline.errors import ProgramError
from genai_pipeline.upstream import pins

log = logging.getLogger(__name__)


def read_program(path: Path):
    """The program's flatbuffer (ExecuTorch's `Program` dataclass) and `segment(index, offset=0,
    size=None)`, a reader of its segments' bytes. Raises ValueError when the segments the flatbuffer
    names run past the end of the file."""
    pins.warn_unpinned(log, "reading .pte files through ExecuTorch's private flatbuffer reader", "executorch")
    try:
        from executorch.exir._serialize._program import _flatbuffer_to_program, _get_extended_header
    except ImportError as e:
        raise ProgramError(
            f"reading a .pte here is written for executorch=={pins.PINNED_EXECUTORCH} ({e}); "
            "install the version pyproject.toml pins"
        ) from None
    path = Path(path)
    with open(path, "rb") as f:
        header = _get_extended_header(f.read(64))
        f.seek(0)
        program = _flatbuffer_to_program(f.read(header.program_size if header else -1))
    base = header.segment_base_offset if header else 0
    end = max((base + s.offset + s.size for s in program.segments or []), default=0)
    if end > path.stat().st_size:
        raise ValueError(f"segments end at byte {end}, past the end of the file")

    def segment(index: int, offset: int = 0, size: int | None = None) -> bytes:  # the whole segment, or a range of it
        with open(path, "rb") as f:
            f.seek(base + program.segments[index].offset + offset)
            return f.read(program.segments[index].size if size is None else size)

    return program, segment
