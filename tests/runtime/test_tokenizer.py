"""Incremental detokenization never emits half a UTF-8 character."""

from conftest import train_tokenizer
from genai_pipeline.runtime.tokenizer import TextStream, Tokenizer


def test_stream_reassembles_multibyte_text(tmp_path):
    tokenizer = Tokenizer(train_tokenizer(tmp_path / "tokenizer.json", 300))
    text = "naïve café — 東京 says “hello” 🙂 to the list object"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) / 4  # rare characters split into byte tokens
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_bos_comes_from_the_tokenizer_post_processor(tmp_path):
    tokenizer = Tokenizer(train_tokenizer(tmp_path / "tokenizer.json", 300))
    assert tokenizer.encode("abc")[0] == 0 and tokenizer.encode("abc", add_special_tokens=False)[0] != 0
