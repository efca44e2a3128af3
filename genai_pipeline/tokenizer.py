"""Tokenizers of checkpoints and exported folders, and incremental detokenization.

One `Tokenizer` reads three kinds of file:
- `tokenizer.json` (Hugging Face `tokenizers`): its post-processor adds BOS where the model wants
  one, exactly as ExecuTorch's C++ tokenizer and Hugging Face read it.
- `tokenizer.model` as SentencePiece (Llama 2, llama2.c's stories models): a protobuf.
- `tokenizer.model` as tiktoken BPE (Llama 3's original files): text lines `base64(token) rank`;
  the split regex and the 256 special tokens after the ranks are Llama 3's, as Meta's code adds them.
The kind of a `tokenizer.model` is read from its content. Neither of those two files adds BOS by
itself: `encode(..., add_special_tokens=True)` prepends it.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Protocol

from genai_pipeline.errors import InputError

# In the order they are looked for in a folder: a Hugging Face folder may hold both, and its
# tokenizer.json is the complete description (special tokens, post-processor).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")

# Special tokens that end an assistant's turn in common chat templates (Llama 3, ChatML, Gemma,
# Phi-3, GPT-2 style); where the vocabulary holds one as a single token, it ends a reply.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "<|eom_id|>")

# Llama 3's pre-tokenizer split (Meta's llama3 tokenizer.py; cl100k's pattern without possessives).
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_NAMED_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)
# Ids len(ranks) + i: 128000 = <|begin_of_text|>, 128009 = <|eot_id|> in Llama 3's 128000 ranks.
LLAMA3_SPECIAL_TOKENS = _LLAMA3_NAMED_SPECIALS + tuple(
    f"<|reserved_special_token_{i}|>" for i in range(2, 2 + 256 - len(_LLAMA3_NAMED_SPECIALS))
)
# tiktoken's regex engine runs out of backtracking stack on very long runs of whitespace (or of
# non-whitespace); Meta's tokenizer cuts such runs into pieces of this many characters.
_MAX_RUN = 25_000
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} \d+")


class TokenizerKind(str, Enum):
    HF_JSON = "tokenizer.json"
    SENTENCEPIECE = "sentencepiece"
    TIKTOKEN = "tiktoken"


def tokenizer_kind(path: Path) -> TokenizerKind:
    """A `.json` file is Hugging Face's; otherwise a tiktoken file starts with a `base64 rank`
    text line, and anything else is taken for a SentencePiece protobuf (its parser then judges)."""
    path = Path(path)
    if path.suffix == ".json":
        return TokenizerKind.HF_JSON
    with path.open("rb") as f:
        first_line = f.read(4096).split(b"\n", 1)[0].rstrip(b"\r")
    return TokenizerKind.TIKTOKEN if _TIKTOKEN_LINE.fullmatch(first_line) else TokenizerKind.SENTENCEPIECE


def find_tokenizer_file(folder: Path) -> Path | None:
    """The folder's tokenizer.json, else its tokenizer.model, else None."""
    return next((Path(folder) / name for name in TOKENIZER_FILES if (Path(folder) / name).is_file()), None)


class _Model(Protocol):
    bos_id: int | None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class Tokenizer:
    """encode / decode over any of the three kinds. `bos_id` is the BOS that a tokenizer.model's
    `encode` prepends (the program's manifest knows it); None: the file's own (SentencePiece's
    bos_id(), tiktoken's <|begin_of_text|>). tokenizer.json ignores it: its post-processor decides."""

    def __init__(self, path: Path, bos_id: int | None = None):
        path = Path(path)
        if not path.is_file():
            raise InputError(
                f"no tokenizer at '{path}'; export from a checkpoint that has tokenizer.json or tokenizer.model"
            )
        self.path = path
        self.kind = tokenizer_kind(path)
        readers = {
            TokenizerKind.HF_JSON: _HFJson,
            TokenizerKind.SENTENCEPIECE: _SentencePiece,
            TokenizerKind.TIKTOKEN: _TiktokenBPE,
        }
        self._model: _Model = readers[self.kind](path, bos_id)

    @classmethod
    def from_folder(cls, folder: Path, bos_id: int | None = None) -> Tokenizer:
        """The tokenizer of a checkpoint or exported folder: tokenizer.json, else tokenizer.model."""
        path = find_tokenizer_file(folder)
        if path is None:
            raise InputError(
                f"'{folder}' has no tokenizer.json or tokenizer.model; export from a checkpoint folder that has one"
            )
        return cls(path, bos_id)

    @property
    def bos_id(self) -> int | None:
        """The id `encode` prepends for a tokenizer.model; None for tokenizer.json (its post-processor's)."""
        return self._model.bos_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._model.encode(text, add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        """Text of the ids, special tokens left out, as Hugging Face's skip_special_tokens=True."""
        return self._model.decode(list(ids))


class _HFJson:
    bos_id = None  # the post-processor places it

    def __init__(self, path: Path, bos_id: int | None):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust parser raises a bare Exception
            raise InputError(f"'{path}' does not parse as a tokenizer.json: {e}") from None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class _SentencePiece:
    def __init__(self, path: Path, bos_id: int | None):
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise InputError(
                f"'{path}' is neither a SentencePiece model nor a tiktoken BPE file ({reason}); "
                "copy tokenizer.model from the original checkpoint again"
            ) from None
        own_bos = self._sp.bos_id()  # -1 when the model has none
        self.bos_id = bos_id if bos_id is not None else (own_bos if own_bos >= 0 else None)
        self._size = self._sp.get_piece_size()

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self._sp.encode(text)
        return [self.bos_id, *ids] if add_special_tokens and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        # Control pieces (BOS, EOS) decode to nothing; ids past the vocabulary (a model's padded
        # embedding rows) are skipped as tokenizer.json skips unknown ids. Byte-fallback pieces
        # that end inside a UTF-8 character decode to U+FFFD, which TextStream waits out.
        return self._sp.decode([i for i in ids if 0 <= i < self._size])


class _TiktokenBPE:
    def __init__(self, path: Path, bos_id: int | None):
        import tiktoken

        ranks = _read_ranks(path)
        specials = {token: len(ranks) + i for i, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self._enc = tiktoken.Encoding(
            name=path.name, pat_str=LLAMA3_SPLIT, mergeable_ranks=ranks, special_tokens=specials
        )
        self._n_ranks = len(ranks)
        self.bos_id = bos_id if bos_id is not None else specials["<|begin_of_text|>"]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # Special-token text (e.g. a rendered chat template's <|start_header_id|>) becomes the
        # special id, as tokenizer.json's added tokens do.
        ids = [i for piece in _bounded_runs(text) for i in self._enc.encode(piece, allowed_special="all")]
        return [self.bos_id, *ids] if add_special_tokens and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        # Special tokens (ids past the ranks) are left out; a partial UTF-8 sequence decodes as U+FFFD.
        return self._enc.decode([i for i in ids if 0 <= i < self._n_ranks])


def _read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file: `base64(token bytes) rank` per line, ranks 0..n-1, all 256 bytes among
    the tokens. Read here rather than by tiktoken.load, which copies local files into a cache
    keyed by their path (a changed file at the same path would read stale)."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise InputError(
                f"'{path}' line {number} is not 'base64-token rank', so it is not a tiktoken BPE file; "
                "copy tokenizer.model from the original checkpoint again"
            ) from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise InputError(
            f"'{path}' is a tiktoken BPE file whose ranks are not 0..{len(ranks) - 1}, each once; the file is damaged"
        )
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise InputError(
            f"'{path}' lacks {len(missing)} of the 256 single-byte tokens a byte-level BPE needs; the file is damaged"
        )
    return ranks


def _bounded_runs(text: str) -> Iterator[str]:
    """`text` in consecutive pieces, cut only inside whitespace or non-whitespace runs longer
    than _MAX_RUN characters (ordinary text stays one piece, so its tokens are unchanged)."""
    start = 0
    for run in re.finditer(r"\s+|\S+", text):
        for cut in range(run.start() + _MAX_RUN, run.end(), _MAX_RUN):
            yield text[start:cut]
            start = cut
    yield text[start:]


class TextStream:
    """Turns a growing list of token ids into text pieces, never emitting half a character:
    a byte-level token can end inside a UTF-8 sequence, which decodes as U+FFFD until the rest
    arrives."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were already emitted; decoding from `prefix` keeps
        self.read = 0  # the context a tokenizer needs to place spaces right (SentencePiece's ▁)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        now = self.tokenizer.decode(self.ids[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        now = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(before) :]
