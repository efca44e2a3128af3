"""upstream/gguf_reader.py: on the pinned gguf the reader parses a file through a plain ndarray view
of its mapping and reads what gguf's own reader reads; on another gguf it is gguf's own reader."""

import logging

import gguf
import numpy as np
import pytest
from pretend_installed import pretend_installed

from genai_pipeline.upstream import gguf_reader


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """Metadata of each kind a checkpoint has (a vocabulary, scores, numbers, a string) and two tensors."""
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"token{i}" for i in range(1000)])
    writer.add_token_scores([float(-i) for i in range(1000)])
    writer.add_uint32("llama.block_count", 2)
    writer.add_string("general.name", "small")
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((1000, 64)).astype(np.float32))
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((64, 64)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_pinned_reader_reads_through_a_plain_view_what_ggufs_own_reads(small_gguf):
    ours, theirs = gguf_reader.gguf_reader(str(small_gguf)), gguf.GGUFReader(str(small_gguf), "r")
    assert type(ours.data) is np.ndarray and isinstance(theirs.data, np.memmap)
    assert isinstance(ours.data.base, np.memmap)  # the view keeps the mapping, not a copy of it
    assert not ours.data.flags.writeable
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].contents() == field.contents(), key
    assert ours.fields["tokenizer.ggml.tokens"].contents()[999] == "token999"
    assert [(t.name, t.tensor_type, list(t.shape)) for t in ours.tensors] == [
        (t.name, t.tensor_type, list(t.shape)) for t in theirs.tensors
    ]
    for mine, upstream in zip(ours.tensors, theirs.tensors):
        assert type(mine.data) is np.ndarray and np.array_equal(mine.data, upstream.data)


def test_another_gguf_gets_ggufs_own_reader_with_a_warning(monkeypatch, caplog, small_gguf):
    pretend_installed(monkeypatch, gguf="0.20.0")
    with caplog.at_level(logging.WARNING, logger=gguf_reader.__name__):
        reader = gguf_reader.gguf_reader(str(small_gguf))
    assert type(reader) is gguf.GGUFReader and isinstance(reader.data, np.memmap)
    assert "gguf 0.20.0 (pinned: 0.19.0)" in caplog.text
