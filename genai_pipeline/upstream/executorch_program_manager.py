"""ExecuTorch's `ExecutorchProgramManager` (executorch==1.5.1), re-serialized so that bytes stored
both as a constant of the program and as named data of a delegate are stored once.

Why: a tied embedding is one table used twice. The LM head is delegated, and XNNPACK stores its
weight as named data (key: SHA-256 of the bytes, looked up by the delegate at load time); the
embedding lookup is not delegated (XNNPACK has no gather), and the emitter puts the same bytes in
the constant segment. Each named data entry names a segment of the file by index, and a segment
is an (offset, size) range, so the entry can name a range inside the constant segment instead of
a copy of its own. Nothing else reads the file differently: the portable lookup reads its
constant where it always did, the delegate reads the same bytes under the same key.

(Pointing the constant at the named data instead, as an `EXTERNAL` tensor, does not load: the
runtime resolves those only from a separate `.ptd` file, never from the program's own named
data; `Method::parse_external_constants` in 1.5.1.)

Relies on, in executorch==1.5.1 (tests/upstream/test_executorch_program_manager.py fails when any of it
changes):
- `ExecutorchProgramManager` serializes at construction from `_emitter_output`, `_named_data`
  and `_data_serializer`, with `serialize_for_executorch`, into `_pte_data` (`buffer` caches
  its bytes in `_buffer`);
- `serialize_pte_binary` lays out every segment, then calls the module-level
  `_program_to_flatbuffer` of `executorch.exir._serialize._program` with the final `segments`,
  `constant_segment` and `named_data`;
- the runtime loads a named data entry as its segment's (offset, size) range, with no check that
  segments do not overlap;
- a constant starts at a multiple of the constant tensor alignment (16) from the segments' base,
  itself a multiple of the segment alignment (128): enough for XNNPACK's named data (16).
On another ExecuTorch than the pinned one, the program is left as ExecuTorch serialized it (the
bytes stored twice; logged once).
"""

from __future__ import annotations

import contextlib
import logging

from genai_pipeline.upstream import pins

log = logging.getLogger(__name__)


def _shared_constants(manager, config) -> dict[str, int]:
    """{named data key: constant buffer index} for the delegates' named data whose bytes are also a
    constant of the program, and whose alignment every constant has."""
    from executorch.exir.tensor import ALIGNMENT

    named = manager._named_data
    program = manager._emitter_output.program
    constant_alignment = (
        config.constant_tensor_alignment or ALIGNMENT
    )  # a constant's offset in the file is a multiple of it
    by_size = {}
    for key, entry in named.pte_data.items() if named is not None else ():
        data = named.buffers[entry.buffer_index]
        # Not a FileBackedData: those stay on disk until written.
        if isinstance(data, bytes) and constant_alignment % entry.alignment == 0:
            by_size.setdefault(len(data), []).append((key, data))
    shared = {}
    for index, buffer in enumerate(program.constant_buffer):
        for key, data in by_size.get(len(buffer.storage), ()) if index > 0 else ():
            if key not in shared and data == buffer.storage:
                shared[key] = index
    return shared


@contextlib.contextmanager
def _named_data_in_constant_segment(shared: dict[str, int], sizes: dict[int, int]):
    """While serializing: each named data key in `shared` gets a segment that is the range of its
    constant buffer inside the constant segment."""
    from executorch.exir._serialize import _program
    from executorch.exir.schema import DataSegment, NamedData

    original = _program._program_to_flatbuffer

    def to_flatbuffer(program, *args, **kwargs):
        constants = program.segments[program.constant_segment.segment_index]
        program.named_data = list(program.named_data or [])
        for key, index in shared.items():
            start = constants.offset + program.constant_segment.offsets[index]
            program.segments.append(DataSegment(offset=start, size=sizes[index]))
            program.named_data.append(NamedData(key=key, segment_index=len(program.segments) - 1))
        return original(program, *args, **kwargs)

    _program._program_to_flatbuffer = to_flatbuffer
    try:
        yield
    finally:
        _program._program_to_flatbuffer = original


def store_shared_bytes_once(manager, config) -> int:
    """Re-serializes `manager` (an ExecutorchProgramManager made with `config`) so that named data
    whose bytes equal a constant of the program is read from that constant. Returns the bytes no
    longer stored twice."""
    import dataclasses

    if not pins.warn_unpinned(
        log, "bytes shared by a constant and a delegate's named data left stored twice", "executorch"
    ):
        return 0

    from executorch.exir._serialize._serialize import serialize_for_executorch

    shared = _shared_constants(manager, config)
    if not shared:
        return 0
    named = manager._named_data
    buffers = manager._emitter_output.program.constant_buffer
    sizes = {index: len(buffers[index].storage) for index in shared.values()}
    own = dataclasses.replace(named, pte_data={k: e for k, e in named.pte_data.items() if k not in shared})
    with _named_data_in_constant_segment(shared, sizes):
        manager._pte_data, manager._tensor_data = serialize_for_executorch(
            manager._emitter_output, config, manager._data_serializer, own
        )
    manager._buffer = None  # `buffer` caches the bytes it made of `_pte_data`
    saved = sum(sizes.values())
    log.debug("%d named data entries read from the constant segment: %d bytes stored once", len(shared), saved)
    return saved
