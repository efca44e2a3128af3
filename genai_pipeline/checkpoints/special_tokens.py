"""A checkpoint's special tokens: bos, every eos, pad and the chat template's end-of-turn tokens.

They are read from the checkpoint folder, where Hugging Face keeps them in several files that
do not always agree: `generation_config.json` (what `generate` stops on: often a list),
`config.json`, `tokenizer_config.json` (tokens spelled as strings) and the chat template (the
token that closes an assistant's turn, e.g. `<|im_end|>`, which the other files may not name).
Every eos any of them names ends generation. The registry entry fills only what the checkpoint
lacks, and `sources` says where each value came from (the manifest records it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from genai_pipeline.errors import CheckpointError
from genai_pipeline.tokenizer import END_OF_TURN_TOKENS, find_tokenizer_file


@dataclass(frozen=True)
class SpecialTokens:
    bos_id: int | None
    eos_ids: tuple[int, ...]  # every token that ends generation, end-of-turn tokens included
    pad_id: int | None = None
    end_of_turn_ids: tuple[int, ...] = ()  # the chat template's, a subset of eos_ids
    # "bos_id" / "eos_ids" / "pad_id" / "end_of_turn_ids" -> the files (or "registry entry") they came from
    sources: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def as_manifest(self) -> dict:
        return {
            "bos_id": self.bos_id,
            "eos_ids": list(self.eos_ids),
            "pad_id": self.pad_id,
            "end_of_turn_ids": list(self.end_of_turn_ids),
            "sources": {k: list(v) for k, v in self.sources.items()},
        }


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"'{path}' is not valid JSON ({e}); re-download or re-save the checkpoint") from None
    return data if isinstance(data, dict) else {}


def _ids(value) -> list[int]:
    """config.json writes an id, a list of ids, or null."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _token_text(value) -> str | None:
    """tokenizer_config.json spells a token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class _Vocabulary:
    """Token text -> id for the special tokens a folder's tokenizer knows: tokenizer.json's added
    tokens and model vocabulary, else (a tokenizer.model) whatever encodes as exactly one token."""

    def __init__(self, folder: Path):
        self.path = find_tokenizer_file(folder)
        self._ids: dict[str, int] = {}
        self._tokenizer = None
        if self.path is not None and self.path.suffix == ".json":
            data = _read_json(self.path)
            vocab = (data.get("model") or {}).get("vocab")
            if isinstance(vocab, dict):
                self._ids.update({k: v for k, v in vocab.items() if isinstance(v, int)})
            self._ids.update(
                {
                    t["content"]: t["id"]
                    for t in data.get("added_tokens") or ()
                    if isinstance(t, dict) and "content" in t
                }
            )
        elif self.path is not None:
            from genai_pipeline.tokenizer import Tokenizer

            self._tokenizer = Tokenizer(self.path)

    def id(self, text: str | None) -> int | None:
        if text is None:
            return None
        if self._tokenizer is not None:
            ids = self._tokenizer.encode(text, add_special_tokens=False)
            return ids[0] if len(ids) == 1 else None
        return self._ids.get(text)


def read_special_tokens(
    folder: Path | None,
    chat_template: str | None,
    fallback_bos: int | None,
    fallback_eos: tuple[int, ...],
    origin: str = "",
) -> SpecialTokens:
    """The special tokens of a checkpoint folder (None: no checkpoint, the entry's own).
    `chat_template`: the template the export will carry (the checkpoint's, else the entry's).
    `origin` prefixes the sources, e.g. "GGUF metadata -> " for files converted from a GGUF."""
    if folder is None:
        return SpecialTokens(
            fallback_bos, tuple(fallback_eos), sources={"bos_id": ("registry entry",), "eos_ids": ("registry entry",)}
        )
    folder = Path(folder)
    generation = _read_json(folder / "generation_config.json")
    config = _read_json(folder / "config.json")
    config = {**config, **(config.get("text_config") or {})}  # multimodal configs nest the decoder's
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    vocabulary = _Vocabulary(folder)
    sources: dict[str, list[str]] = {}

    def first(name: str, candidates) -> int | None:
        for source, value in candidates:
            if value is not None:
                sources[name] = [origin + source]
                return value
        return None

    bos = first(
        "bos_id",
        [
            ("generation_config.json", next(iter(_ids(generation.get("bos_token_id"))), None)),
            ("config.json", next(iter(_ids(config.get("bos_token_id"))), None)),
            ("tokenizer_config.json", vocabulary.id(_token_text(tokenizer_config.get("bos_token")))),
        ],
    )
    pad = first(
        "pad_id",
        [
            ("generation_config.json", next(iter(_ids(generation.get("pad_token_id"))), None)),
            ("config.json", next(iter(_ids(config.get("pad_token_id"))), None)),
            ("tokenizer_config.json", vocabulary.id(_token_text(tokenizer_config.get("pad_token")))),
        ],
    )
    eos: dict[int, list[str]] = {}
    for source, ids in (
        ("generation_config.json", _ids(generation.get("eos_token_id"))),
        ("config.json", _ids(config.get("eos_token_id"))),
        ("tokenizer_config.json", _ids(vocabulary.id(_token_text(tokenizer_config.get("eos_token"))))),
    ):
        for i in ids:
            eos.setdefault(i, []).append(origin + source)
    end_of_turn = []
    for text in END_OF_TURN_TOKENS if chat_template else ():
        token = vocabulary.id(text) if text in chat_template else None
        if token is not None:
            end_of_turn.append(token)
            eos.setdefault(token, []).append(f"chat template ({text})")
    if bos is None and fallback_bos is not None:
        bos, sources["bos_id"] = fallback_bos, ["registry entry"]
    if not eos:
        eos = {i: ["registry entry"] for i in fallback_eos}
    sources["eos_ids"] = sorted({s for found in eos.values() for s in found})
    if end_of_turn:
        sources["end_of_turn_ids"] = ["chat template"]
    return SpecialTokens(
        bos_id=bos,
        eos_ids=tuple(eos),
        pad_id=pad,
        end_of_turn_ids=tuple(end_of_turn),
        sources={k: tuple(v) for k, v in sources.items()},
    )
