"""upstream/executorch_pte_reader.py: the pinned wheel parses a .pte's flatbuffer without its
segments, and read_program agrees with ExecuTorch's own full deserializer."""

import pytest
import torch
from executorch.exir import to_edge_transform_and_lower
from executorch.exir._serialize._program import deserialize_pte_binary

from genai_pipeline.errors import ProgramError
from genai_pipeline.upstream.executorch_pte_reader import read_program


@pytest.fixture(scope="module")
def pte(tmp_path_factory):
    module = torch.nn.Linear(8, 4)
    program = to_edge_transform_and_lower(torch.export.export(module, (torch.randn(2, 8),))).to_executorch()
    path = tmp_path_factory.mktemp("pte") / "linear.pte"
    path.write_bytes(program.buffer)
    return path


def test_the_flatbuffer_and_segments_read_are_executorchs_own(pte):
    program, segment = read_program(pte)
    full = deserialize_pte_binary(pte.read_bytes())
    full = getattr(full, "program", full)
    assert [p.name for p in program.execution_plan] == [p.name for p in full.execution_plan] == ["forward"]
    # the full deserializer copies the constant segment into constant_buffer: the same bytes, read by range
    constants = segment(program.constant_segment.segment_index)
    offsets = program.constant_segment.offsets
    stored = [b.storage for b in full.constant_buffer]
    assert len(offsets) == len(stored) == 3  # index 0 is reserved; the weight, the bias
    for start, data in zip(offsets[1:], stored[1:]):
        assert len(data) > 0 and constants[start : start + len(data)] == data


def test_a_file_cut_short_is_refused(pte, tmp_path):
    program, _ = read_program(pte)
    if not program.segments:
        pytest.skip("this program keeps its constants inline")
    cut = tmp_path / "cut.pte"
    cut.write_bytes(pte.read_bytes()[: -program.segments[-1].size // 2 - 1])
    with pytest.raises(ValueError, match="past the end of the file"):
        read_program(cut)


def test_without_the_private_reader_one_line_names_the_pinned_version(pte, monkeypatch):
    import executorch.exir._serialize._program as upstream

    monkeypatch.delattr(upstream, "_flatbuffer_to_program")
    with pytest.raises(ProgramError, match="written for executorch==1.5.1"):
        read_program(pte)
