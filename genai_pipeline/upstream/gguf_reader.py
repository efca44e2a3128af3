"""gguf's GGUFReader, reading its file through a plain ndarray view of the mapping.

The pinned gguf's `GGUFReader.__init__` maps the file as an `np.memmap` (`self.data`) and parses
every metadata value, vocabulary entry and tensor header as a slice of it. numpy runs Python code
for each slice of a memmap (`memmap.__array_finalize__`, `memmap.__getitem__`): on a vocabulary of
a quarter of a million tokens that is most of the time an export spends opening the file
(docs/upstream-patches.md has the figures). `gguf_reader` gives the reader a plain ndarray view of
the same mapping instead, as it is assigned: the same bytes, no copy, the mapping kept alive as the
view's base. On another gguf the reader is upstream's own, with one warning.
tests/upstream/test_gguf_reader.py fails when the pinned gguf stops assigning `data` in __init__ or
reads a file differently through the view.
"""

from __future__ import annotations

import functools
import logging

import numpy as np

from genai_pipeline.upstream import pins

log = logging.getLogger(__name__)


def gguf_reader(path: str):
    """A read-only GGUFReader of `path`; raises what the reader raises on a damaged file."""
    import gguf

    if not pins.warn_unpinned(log, "gguf's reader parses the file through memmap slices (slower)", "gguf"):
        return gguf.GGUFReader(path, "r")
    return _plain_array_reader()(path, "r")


@functools.cache
def _plain_array_reader() -> type:
    import gguf

    class PlainArrayReader(gguf.GGUFReader):
        """GGUFReader whose `data`, set to an np.memmap by its __init__, is kept as a plain view."""

        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return PlainArrayReader
