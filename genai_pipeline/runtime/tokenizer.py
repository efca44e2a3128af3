"""Tokenizer from an exported folder's tokenizer.json, and incremental detokenization."""

from __future__ import annotations

from pathlib import Path

from genai_pipeline.errors import InputError


class Tokenizer:
    """tokenizer.json decides the special tokens around a prompt (its post-processor adds BOS where
    the model wants one), exactly as ExecuTorch's C++ tokenizer and Hugging Face read it."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not path.is_file():
            raise InputError(f"no tokenizer at '{path}'; export from a checkpoint that has tokenizer.json, or pass token ids")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust parser raises a bare Exception
            raise InputError(f"'{path}' does not parse as a tokenizer.json: {e}") from None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class TextStream:
    """Turns a growing list of token ids into text pieces, never emitting half a character:
    a byte-level token can end inside a UTF-8 sequence, which decodes as U+FFFD until the rest
    arrives."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were already emitted; decoding from `prefix` keeps
        self.read = 0  # the context a tokenizer needs to place spaces right

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
