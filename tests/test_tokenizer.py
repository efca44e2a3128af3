"""Tokenizers: tokenizer.json, SentencePiece and tiktoken tokenizer.model files against independent
implementations (sentencepiece itself and transformers' converted tokenizers), BOS handling, file
detection, one clear line for a bad file, and incremental detokenization that never emits half a
UTF-8 character."""

from collections import Counter

import pytest
import regex
from conftest import train_sentencepiece, train_tokenizer

from genai_pipeline.errors import InputError
from genai_pipeline.tokenizer import (
    LLAMA3_SPECIAL_TOKENS,
    LLAMA3_SPLIT,
    TextStream,
    Tokenizer,
    TokenizerKind,
    tokenizer_kind,
)

PROSE = [
    "The list object supports slicing: a[1:3] returns 2 items.",
    "Once upon a time, 12345 tiny llamas\nwalked   home\tquietly.",
    "ends with a space ",
    "",
]
MULTIBYTE = "naïve café — 東京 says “hello” 🙂 to the list object"


def bpe_ranks(text: str, merges: int) -> dict[bytes, int]:
    """A tiny byte-level BPE in tiktoken's form: the 256 bytes, then the most frequent adjacent
    pair within Llama 3's pre-tokens, merged `merges` times."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in word.encode()] for word in regex.findall(LLAMA3_SPLIT, text)]
    for _ in range(merges):
        (a, b), _ = Counter(pair for w in words for pair in zip(w, w[1:])).most_common(1)[0]
        ranks[a + b] = len(ranks)
        merged = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged.append(out)
        words = merged
    return ranks


def write_tiktoken(path, ranks: dict[bytes, int]):
    import base64

    path.write_bytes(b"".join(base64.b64encode(t) + b" " + str(r).encode() + b"\n" for t, r in ranks.items()))
    return path


@pytest.fixture(scope="module")
def sentencepiece_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sentencepiece")
    train_sentencepiece(folder / "tokenizer.model")
    return folder


@pytest.fixture(scope="module")
def tiktoken_folder(tmp_path_factory):
    import pydoc_data.topics

    folder = tmp_path_factory.mktemp("tiktoken")
    text = "\n".join(sorted(pydoc_data.topics.topics.values()))[:20_000]
    write_tiktoken(folder / "tokenizer.model", bpe_ranks(text, merges=200))
    return folder


@pytest.fixture(scope="module")
def json_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("json")
    train_tokenizer(folder / "tokenizer.json", 300)
    return folder


def test_sentencepiece_matches_sentencepiece_and_transformers(sentencepiece_folder):
    import sentencepiece
    from transformers import LlamaTokenizer

    ours = Tokenizer.from_folder(sentencepiece_folder)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_folder / "tokenizer.model"))
    hf = LlamaTokenizer.from_pretrained(sentencepiece_folder)  # tokenizers' BPE built from the same pieces
    assert ours.kind is TokenizerKind.SENTENCEPIECE and ours.bos_id == 1
    for text in PROSE + [MULTIBYTE]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text) == hf.encode(text, add_special_tokens=False), text
        assert ours.encode(text) == [1, *ids]  # the file adds no BOS; encode prepends it
        assert ours.decode([1, *ids, 2]) == text  # BOS and EOS decode to nothing
    assert len(ours.encode(PROSE[1], add_special_tokens=False)) > 10  # real merges, not only bytes


def test_sentencepiece_bos_can_be_given(sentencepiece_folder):
    assert Tokenizer.from_folder(sentencepiece_folder, bos_id=7).encode("abc")[0] == 7


def test_tiktoken_matches_transformers_conversion(tiktoken_folder, monkeypatch):
    from transformers.convert_slow_tokenizer import TikTokenConverter

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # the converter reads the file through tiktoken: no cache copy
    path = tiktoken_folder / "tokenizer.model"
    hf = TikTokenConverter(
        vocab_file=str(path), pattern=LLAMA3_SPLIT, extra_special_tokens=LLAMA3_SPECIAL_TOKENS
    ).converted()
    ours = Tokenizer.from_folder(tiktoken_folder)
    n_ranks = 256 + 200
    assert ours.kind is TokenizerKind.TIKTOKEN and ours.bos_id == n_ranks  # <|begin_of_text|> follows the ranks
    for text in PROSE + [MULTIBYTE, "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text
        assert ours.encode(text) == [n_ranks, *ids]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    eot = ours.encode("<|eot_id|>", add_special_tokens=False)
    assert eot == [n_ranks + 9]  # Llama 3's 128009 in a 128000-rank file
    assert ours.decode(ours.encode(PROSE[1] + "<|eot_id|>")) == PROSE[1]  # special tokens are not shown
    assert len(ours.encode(PROSE[0], add_special_tokens=False)) < len(PROSE[0].encode())  # merges apply


def test_tiktoken_survives_very_long_whitespace_runs(tiktoken_folder):
    """tiktoken's regex alone fails on a run this long ("Max stack size exceeded for backtracking")."""
    text = "a" + " " * 1_000_000 + "b"
    tokenizer = Tokenizer.from_folder(tiktoken_folder)
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("kind", ["json", "sentencepiece", "tiktoken"])
def test_stream_reassembles_multibyte_text(kind, request):
    tokenizer = Tokenizer.from_folder(request.getfixturevalue(f"{kind}_folder"))
    text = MULTIBYTE + "\nOnce upon a time,  there was\ta list."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode()) / 4  # rare characters split into byte tokens
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert sum(1 for p in pieces if p.startswith(" ")) >= 5  # spaces between words are kept (SentencePiece's ▁)


def test_bos_comes_from_the_tokenizer_post_processor(json_folder):
    tokenizer = Tokenizer.from_folder(json_folder, bos_id=5)  # tokenizer.json decides, not bos_id
    assert tokenizer.kind is TokenizerKind.HF_JSON and tokenizer.bos_id is None
    assert tokenizer.encode("abc")[0] == 0 and tokenizer.encode("abc", add_special_tokens=False)[0] != 0


def test_kind_is_read_from_the_content(tmp_path, sentencepiece_folder, tiktoken_folder):
    # Swapped names and suffixes do not matter for a tokenizer.model: its bytes decide.
    (tmp_path / "a.model").write_bytes((tiktoken_folder / "tokenizer.model").read_bytes())
    (tmp_path / "b.model").write_bytes((sentencepiece_folder / "tokenizer.model").read_bytes())
    assert tokenizer_kind(tmp_path / "a.model") is TokenizerKind.TIKTOKEN
    assert tokenizer_kind(tmp_path / "b.model") is TokenizerKind.SENTENCEPIECE


def test_folder_prefers_tokenizer_json(tmp_path, json_folder, sentencepiece_folder):
    (tmp_path / "tokenizer.model").write_bytes((sentencepiece_folder / "tokenizer.model").read_bytes())
    assert Tokenizer.from_folder(tmp_path).kind is TokenizerKind.SENTENCEPIECE
    (tmp_path / "tokenizer.json").write_bytes((json_folder / "tokenizer.json").read_bytes())
    assert Tokenizer.from_folder(tmp_path).kind is TokenizerKind.HF_JSON


def _one_line_error(folder) -> str:
    with pytest.raises(InputError) as e:
        Tokenizer.from_folder(folder)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_a_folder_without_tokenizer(tmp_path):
    message = _one_line_error(tmp_path)
    assert str(tmp_path) in message and "tokenizer.json or tokenizer.model" in message


def test_a_file_that_is_no_tokenizer(tmp_path):
    (tmp_path / "tokenizer.model").write_text("this is not a tokenizer\n")
    message = _one_line_error(tmp_path)
    assert "tokenizer.model" in message and "neither a SentencePiece model nor a tiktoken BPE file" in message


def test_a_damaged_tiktoken_file_names_the_line(tmp_path, tiktoken_folder):
    lines = (tiktoken_folder / "tokenizer.model").read_bytes().splitlines(keepends=True)
    (tmp_path / "tokenizer.model").write_bytes(b"".join(lines[:300]) + lines[300][:5] + b"\n" + b"".join(lines[301:]))
    assert "line 301" in _one_line_error(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"".join(lines[:100] + lines[101:]))  # a rank and a byte missing
    assert "ranks are not 0..454" in _one_line_error(tmp_path)


def test_a_truncated_sentencepiece_model(tmp_path, sentencepiece_folder):
    (tmp_path / "tokenizer.model").write_bytes((sentencepiece_folder / "tokenizer.model").read_bytes()[:301])
    assert "neither a SentencePiece model" in _one_line_error(tmp_path)


def test_a_broken_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    assert "does not parse as a tokenizer.json" in _one_line_error(tmp_path)
