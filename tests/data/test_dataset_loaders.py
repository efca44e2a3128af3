"""The `text` and `messages` datasets, and one clear error per kind of bad file."""

import json

import pytest

from genai_pipeline.data import ContentPart, Message, load_dataset
from genai_pipeline.data.loaders import load_messages, load_text
from genai_pipeline.errors import DataError
from genai_pipeline.options import DatasetSpec

CHAT = [
    {
        "messages": [
            {"role": "user", "content": "What is a list?"},
            {"role": "assistant", "content": "A mutable sequence."},
        ]
    },
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
]


def _write_json(path, data):
    path.write_text(json.dumps(data))
    return path


def _error(loader, path) -> str:
    with pytest.raises(DataError) as e:
        loader(path)
    return str(e.value)


def test_text_splits_documents_on_blank_lines(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("First document,\nsecond line.\n\n\nSecond document.\r\n  \r\nThird — naïve.\n", encoding="utf-8")
    samples = load_text(f)
    assert [s.text for s in samples] == ["First document,\nsecond line.", "Second document.", "Third — naïve."]
    assert [s.text for s in load_text(f, limit=2)] == ["First document,\nsecond line.", "Second document."]
    assert samples[1].origin == f"'{f}' document 1"


def test_messages_from_a_json_array(tmp_path):
    samples = load_dataset(DatasetSpec("messages", str(_write_json(tmp_path / "chat.json", CHAT))))
    assert samples[0].messages == (Message("user", "What is a list?"), Message("assistant", "A mutable sequence."))
    assert samples[1].messages[0] == Message("system", "Be brief.")
    assert all(s.text is None and s.images == () for s in samples)


def test_messages_from_json_lines_with_limit(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text("\n".join(json.dumps(s) for s in CHAT * 3) + "\n")
    assert len(load_messages(f)) == 6
    assert [s.messages for s in load_messages(f, limit=3)] == [load_messages(f)[i].messages for i in range(3)]


def test_multimodal_parts_resolve_images_next_to_the_json(tmp_path):
    (tmp_path / "img").mkdir()
    cat, dog = tmp_path / "img" / "cat.png", tmp_path / "dog.png"
    cat.write_bytes(b"\x89PNG")
    dog.write_bytes(b"\x89PNG")
    content = [
        {"type": "image", "image": "img/cat.png"},
        {"type": "text", "text": "and"},
        {"type": "image", "path": "dog.png"},
    ]
    [sample] = load_messages(
        _write_json(tmp_path / "vision.json", [{"messages": [{"role": "user", "content": content}]}])
    )
    assert sample.images == (cat, dog)
    assert sample.messages[0].content == (
        ContentPart("image", image=cat),
        ContentPart("text", text="and"),
        ContentPart("image", image=dog),
    )


def test_missing_image_is_named(tmp_path):
    chat = [{"messages": [{"role": "user", "content": [{"type": "image", "image": "nope.png"}]}]}]
    message = _error(load_messages, _write_json(tmp_path / "vision.json", chat))
    assert str(tmp_path / "nope.png") in message and "does not exist" in message and "sample 0" in message


def test_image_url_is_not_downloaded(tmp_path):
    chat = [{"messages": [{"role": "user", "content": [{"type": "image", "url": "https://x.org/a.png"}]}]}]
    assert "is a URL" in _error(load_messages, _write_json(tmp_path / "vision.json", chat))


@pytest.mark.parametrize("loader", [load_text, load_messages])
def test_missing_file(tmp_path, loader):
    message = _error(loader, tmp_path / "absent.txt")
    assert str(tmp_path / "absent.txt") in message and "does not exist" in message


@pytest.mark.parametrize("loader, content", [(load_text, "\n \n\n"), (load_messages, "[]")])
def test_empty_dataset(tmp_path, loader, content):
    f = tmp_path / "empty"
    f.write_text(content)
    assert "holds no samples" in _error(loader, f)


def test_text_that_is_not_utf8(tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("café".encode("latin-1"))
    assert "not UTF-8" in _error(load_text, f) and "offset 3" in _error(load_text, f)


def test_malformed_json_says_where(tmp_path):
    f = tmp_path / "chat.json"
    f.write_text('[\n  {"messages": []},\n  {"messages": [}\n]')
    message = _error(load_messages, f)
    assert "not valid JSON" in message and "line 3" in message


def test_malformed_json_line_says_which(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps(CHAT[0]) + "\n{oops\n")
    assert "line 2 is not valid JSON" in _error(load_messages, f)


@pytest.mark.parametrize(
    "record, problem",
    [
        ({"conversation": []}, "'messages' list"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"content": "hi"}]}, "message 0: message has no 'role'"),
        ({"messages": [{"role": "user"}]}, "message 0: message has no 'content'"),
        ({"messages": ["hi"]}, "must be an object"),
        (
            {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}]},
            "unsupported content part type 'audio'",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text part needs a string 'text'"),
    ],
)
def test_wrong_schema_names_the_problem(tmp_path, record, problem):
    message = _error(load_messages, _write_json(tmp_path / "chat.json", [CHAT[0], record]))
    assert problem in message and "sample 1" in message


def test_one_pretty_printed_object_instead_of_an_array(tmp_path):
    f = tmp_path / "chat.json"
    f.write_text(json.dumps(CHAT[0], indent=2))
    assert "holds one JSON object; expected an array" in _error(load_messages, f)
