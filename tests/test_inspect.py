import pytest

from genai_pipeline.errors import ProgramError
from genai_pipeline.inspect import inspect_program


def test_sizes_read_from_the_flatbuffer_match_executorchs_full_deserialization(export_tiny):
    # inspect never reads the weights; ExecuTorch's deserializer reads and splits them all.
    from executorch.exir._serialize._program import deserialize_pte_binary

    pte = export_tiny("hybrid") / "text_decoder.pte"
    report = inspect_program(pte)
    full = deserialize_pte_binary(pte.read_bytes())
    named = full.named_data
    assert report["named_data"]["entries"] == len(named.pte_data) > 0
    assert report["named_data"]["bytes"] == sum(len(named.buffers[e.buffer_index]) for e in named.pte_data.values())
    used = {
        t.val.data_buffer_idx
        for plan in full.program.execution_plan
        for t in plan.values
        if type(t.val).__name__ == "Tensor" and t.val.allocation_info is None and t.val.data_buffer_idx > 0
    }
    assert report["constant_segment"]["bytes"] == sum(len(full.program.constant_buffer[i].storage) for i in used)
    for name, method in report["methods"].items():
        plan = next(p for p in full.program.execution_plan if p.name == name)
        assert method["delegate_bytes"] == sum(
            len(full.program.backend_delegate_data[d.processed.index].data) for d in plan.delegates
        )


def test_a_program_cut_short_inside_its_weights_is_refused(tmp_path, export_tiny):
    good = (export_tiny("hybrid") / "text_decoder.pte").read_bytes()
    pte = tmp_path / "cut.pte"
    pte.write_bytes(good[: len(good) - 1024])  # the flatbuffer is whole, the last segment is not
    with pytest.raises(ProgramError, match="corrupt or truncated"):
        inspect_program(pte)
