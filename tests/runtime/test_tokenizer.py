"""Incremental detokenization never emits half a UTF-8 character."""

from conftest import train_tokenizer
from genai_pipeline.runtime.tokenizer import TextStream, Tokenizer


def test_stream_reassembles_multibyte_text(tmp_path):
    tokenizer = Tokenizer(train_tokenizer(tmp_path / "tokenizer.json", 300), bos_id=0)
    text = "naïve café — 東京 says “hello” 🙂 to the list object"
    ids = tokenizer.encode(text, add_bos=False)
    assert len(ids) > len(text.encode()) / 4  # rare characters split into byte tokens
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_bos_is_prepended(tmp_path):
    tokenizer = Tokenizer(train_tokenizer(tmp_path / "tokenizer.json", 300), bos_id=0)
    assert tokenizer.encode("abc")[0] == 0 and tokenizer.encode("abc", add_bos=False)[0] != 0
