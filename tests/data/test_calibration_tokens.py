"""CalibrationOptions end to end: datasets concatenated in order, the limit, random data."""

import json

import pytest
from conftest import train_tokenizer

from genai_pipeline.chat_template import ChatTemplate
from genai_pipeline.data import LOADERS, calibration_steps, calibration_tokens, random_token_lists
from genai_pipeline.errors import DataError, InputError
from genai_pipeline.options import DATASET_KINDS, CalibrationOptions
from genai_pipeline.tokenizer import Tokenizer

VOCAB = 300
CHATML = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer(train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", VOCAB))


@pytest.fixture
def files(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("alpha one\n\nbeta two\n\ngamma three\n")
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]))
    return text, chat


def test_every_kind_has_a_loader():
    assert set(LOADERS) | {"random"} == set(DATASET_KINDS)


def test_datasets_are_concatenated_in_order(tokenizer, files):
    text, chat = files
    options = CalibrationOptions(datasets=(f"text:{text}", f"messages:{chat}"))
    tokens = calibration_tokens(options, tokenizer, vocab_size=VOCAB, chat_template=ChatTemplate(CHATML))
    assert tokens == [tokenizer.encode(t) for t in ("alpha one", "beta two", "gamma three")] + [
        tokenizer.encode(f"<|im_start|>user\nq{i}<|im_end|>\n", add_special_tokens=False) for i in range(3)
    ]


def test_limit_counts_samples_across_datasets(tokenizer, files, tmp_path):
    text, chat = files
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    # 3 text documents + 1 chat sample; the broken file after them is never opened.
    options = CalibrationOptions(datasets=(f"text:{text}", f"messages:{chat}", f"messages:{broken}"), limit=4)
    tokens = calibration_tokens(options, tokenizer, vocab_size=VOCAB)
    assert len(tokens) == 4 and tokens[3] == tokenizer.encode("user: q0\n")  # no template: the fallback


def test_random_makes_limit_or_8_samples_of_seq_len(tokenizer, files):
    text, _ = files
    assert len(calibration_tokens(CalibrationOptions(("random",), seq_len=5), None, vocab_size=VOCAB)) == 8
    options = CalibrationOptions((f"text:{text}", "random"), limit=6, seq_len=5)
    tokens = calibration_tokens(options, tokenizer, vocab_size=VOCAB, seed=3)
    assert tokens[3:] == random_token_lists(3, seq_len=5, vocab_size=VOCAB, seed=3 + 1)


def test_steps_for_a_prefill_graph(tokenizer, files):
    text, _ = files
    options = CalibrationOptions((f"text:{text}",), seq_len=3)
    steps = calibration_steps(options, tokenizer, chunk_len=2, max_seq_len=8, vocab_size=VOCAB)
    first = tokenizer.encode("alpha one")[:3]
    assert [s.tokens[0].tolist() for s in steps[:2]] == [first[:2], first[2:] + [0]]
    assert [s.reset_cache for s in steps] == [True, False] * 3


def test_no_datasets(tokenizer):
    with pytest.raises(DataError, match="no calibration data given; pass --calib"):
        calibration_tokens(CalibrationOptions(), tokenizer, vocab_size=VOCAB)


def test_file_dataset_without_a_tokenizer(files):
    with pytest.raises(DataError, match="needs the model's tokenizer"):
        calibration_tokens(CalibrationOptions((f"text:{files[0]}",)), None, vocab_size=VOCAB)


def test_seq_len_is_checked_before_reading_data(tokenizer, tmp_path):
    options = CalibrationOptions((f"text:{tmp_path / 'absent.txt'}",), seq_len=64)
    with pytest.raises(InputError, match="--calib-seq-len 64"):
        calibration_steps(options, tokenizer, chunk_len=8, max_seq_len=32, vocab_size=VOCAB)


def test_missing_dataset_file(tokenizer, tmp_path):
    options = CalibrationOptions((f"hf-chat:{tmp_path / 'nope'}",))
    with pytest.raises(DataError, match="nope' does not exist"):
        calibration_tokens(options, tokenizer, vocab_size=VOCAB)
