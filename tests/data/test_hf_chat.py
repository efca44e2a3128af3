"""`hf-chat`: parquet, Arrow (as `datasets.save_to_disk` writes it) and jsonl folders, read with pyarrow."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genai_pipeline.data import Message, Sample
from genai_pipeline.data.hf_chat import load_hf_chat
from genai_pipeline.errors import DataError

ROWS = [
    {"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]}
    for i in range(5)
]


def _write_arrow_stream(path, rows):
    """The layout of `Dataset.save_to_disk`: Arrow IPC *stream* files plus two JSON files."""
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)
    (path.parent / "dataset_info.json").write_text("{}")
    (path.parent / "state.json").write_text('{"_data_files": []}')


def _error(folder) -> str:
    with pytest.raises(DataError) as e:
        load_hf_chat(folder)
    return str(e.value)


def test_parquet_files_of_a_hub_snapshot_in_name_order(tmp_path):
    (tmp_path / "data").mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[3:]), tmp_path / "data" / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[:3]), tmp_path / "data" / "train-00000-of-00002.parquet")
    samples = load_hf_chat(tmp_path)
    assert [s.messages[0].content for s in samples] == [f"Question {i}?" for i in range(5)]
    assert samples[4].messages[1] == Message("assistant", "Answer 4.")


def test_arrow_stream_as_save_to_disk_writes_it(tmp_path):
    _write_arrow_stream(tmp_path / "data-00000-of-00001.arrow", ROWS)
    samples = load_hf_chat(tmp_path)
    assert len(samples) == 5 and samples[2].messages[0] == Message("user", "Question 2?")
    assert samples[2].origin == f"'{tmp_path / 'data-00000-of-00001.arrow'}' row 2"


def test_arrow_file_format_too(tmp_path):
    table = pa.Table.from_pylist(ROWS)
    with pa.OSFile(str(tmp_path / "chat.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    assert len(load_hf_chat(tmp_path)) == 5


def test_text_column_skips_blank_rows(tmp_path):
    pq.write_table(pa.table({"text": ["", " = Title = \n", "  \n", "Body text.\n", None]}), tmp_path / "wiki.parquet")
    assert [s.text for s in load_hf_chat(tmp_path)] == [" = Title = \n", "Body text.\n"]


def test_jsonl_files(tmp_path):
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    assert len(load_hf_chat(tmp_path)) == 5


def test_limit_stops_reading(tmp_path):
    # The second file is broken: with the limit met by the first, it is never read.
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_bytes(b"not parquet")
    assert len(load_hf_chat(tmp_path, limit=4)) == 4
    assert "cannot read" in _error(tmp_path)


def test_image_parts_in_struct_columns(tmp_path):
    (tmp_path / "cat.png").write_bytes(b"\x89PNG")
    content = [{"type": "image", "image": "cat.png", "text": None}, {"type": "text", "image": None, "text": "What?"}]
    pq.write_table(pa.Table.from_pylist([{"messages": [{"role": "user", "content": content}]}]), tmp_path / "v.parquet")
    [sample] = load_hf_chat(tmp_path)
    assert sample.images == (tmp_path / "cat.png",) and sample.messages[0].text == "What?"


def test_a_dataset_dict_asks_for_a_split(tmp_path):
    (tmp_path / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        _write_arrow_stream(tmp_path / split / "data-00000-of-00001.arrow", ROWS)
    message = _error(tmp_path)
    assert "train, test" in message and f"hf-chat:{tmp_path / 'train'}" in message
    assert len(load_hf_chat(tmp_path / "train")) == 5


def test_missing_folder(tmp_path):
    assert "does not exist" in _error(tmp_path / "nope")


def test_folder_without_data_files(tmp_path):
    (tmp_path / "README.md").write_text("hi")
    assert "holds no *.parquet, *.arrow, *.jsonl files" in _error(tmp_path)


def test_no_messages_or_text_column(tmp_path):
    pq.write_table(pa.table({"prompt": ["a"], "completion": ["b"]}), tmp_path / "x.parquet")
    message = _error(tmp_path)
    assert "no 'messages' or 'text' column" in message and "prompt, completion" in message


def test_truncated_arrow(tmp_path):
    _write_arrow_stream(tmp_path / "data.arrow", ROWS)
    data = (tmp_path / "data.arrow").read_bytes()
    (tmp_path / "data.arrow").write_bytes(data[: len(data) // 2])
    assert "cannot read" in _error(tmp_path) and "as Arrow" in _error(tmp_path)


def test_bad_message_in_a_row_is_located(tmp_path):
    rows = ROWS[:2] + [{"messages": [{"role": None, "content": "x"}]}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "x.parquet")
    assert "row 2, message 0: message has no 'role'" in _error(tmp_path)


def test_empty_dataset(tmp_path):
    pq.write_table(pa.table({"text": ["", "  "]}), tmp_path / "x.parquet")
    assert "holds no samples" in _error(tmp_path)


def test_text_rows_are_samples(tmp_path):
    pq.write_table(pa.table({"text": ["one"]}), tmp_path / "x.parquet")
    assert load_hf_chat(tmp_path)[0] == Sample(text="one", origin=f"'{tmp_path / 'x.parquet'}' row 0")
