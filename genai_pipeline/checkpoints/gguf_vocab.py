"""A GGUF's vocabulary as the tokenizer.json, tokenizer_config.json and generation_config.json
a Hugging Face folder would hold.

The tokenizer.json must be read alike by `tokenizers` (our runtime) and by ExecuTorch's C++
tokenizer (`pytorch_tokenizers`, used by TextLLMRunner), so it keeps to the components both know:
BPE; Split / Digits / ByteLevel pre-tokenizers; Prepend / Replace normalizers; ByteLevel or
Replace + ByteFallback + Fuse + Strip decoders.

Two kinds of vocabulary (`tokenizer.ggml.model`):
- `gpt2`: byte-level BPE with merges. How text is split before the merges is not in the file, only
  a name (`tokenizer.ggml.pre`) for llama.cpp's table of split regexes; `PRE_TOKENIZERS` holds the
  ones we know, and others fall back to GPT-2's (with a warning).
- `llama`: SentencePiece BPE (scores, byte-fallback tokens <0xNN>), spaces as U+2581, a space
  prepended to the text when `tokenizer.ggml.add_space_prefix` (default true). Merges come from
  the file or, when it has none, from the scores, as Hugging Face's SentencePiece converter
  derives them: every split of a token into two tokens, best merged score first.
Tokens marked CONTROL (3) become special added tokens, USER_DEFINED (4) plain added tokens, so
both are matched whole in text as llama.cpp does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from genai_pipeline.checkpoints.gguf import metadata as _field
from genai_pipeline.errors import CheckpointError

log = logging.getLogger(__name__)

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # tokenizer.ggml.token_type values (llama.cpp's)
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


DIGITS = {"type": "Digits", "individual_digits": True}
# tokenizer.ggml.pre -> (pre-tokenizers, ignore_merges), after llama.cpp's llama-vocab.cpp regex table.
# `ignore_merges`: a whole pre-token found in the vocabulary is taken as is (Llama 3's tokenizer).
PRE_TOKENIZERS: dict[str, tuple[list[dict], bool]] = {
    "default": ([_byte_level(True)], False),
    "gpt2": ([_byte_level(True)], False),
    # SmolLM, StarCoder, ...: every digit alone, then GPT-2's split
    **{pre: ([DIGITS, _byte_level(True)], False) for pre in ("smollm", "starcoder", "refact", "command-r", "codeshell")},
    **{pre: ([_split(LLAMA3_SPLIT), _byte_level(False)], True) for pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")},
    **{pre: ([_split(QWEN2_SPLIT), _byte_level(False)], False) for pre in ("qwen2", "deepseek-r1-qwen")},
}

# No normalizer, not even Qwen's NFC: llama.cpp applies none, and ExecuTorch 1.5.1's C++ NFC
# normalizer encodes "naïve" differently from `tokenizers` (tested).


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of every byte (the alphabet of byte-level vocabularies)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _added_tokens(tokens: list[str], types: list[int], alphabet: set[str] | None) -> list[dict]:
    added = []
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind not in (UNKNOWN, CONTROL, USER_DEFINED):
            continue
        kind = CONTROL if kind == UNKNOWN else kind  # <unk> is special, as in Hugging Face's files
        if kind == CONTROL and alphabet is not None and not set(token) <= alphabet:
            continue  # a byte-level vocabulary cannot hold it as a token: a mislabel llama.cpp tolerates
        added.append({
            "id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": kind == USER_DEFINED and alphabet is None, "special": kind == CONTROL,
        })
    return added


def _post_processor(tokens: list[str], bos: int | None, eos: int | None, add_bos: bool, add_eos: bool) -> dict | None:
    """BOS/EOS the tokenizer adds itself, as tokenizer.ggml.add_bos_token / add_eos_token say."""
    first = [tokens[bos]] if add_bos and bos is not None else []
    last = [tokens[eos]] if add_eos and eos is not None else []
    if not first and not last:
        return None
    ids = {t: [tokens.index(t)] for t in first + last}

    def seq(piece: str) -> list[dict]:
        return [{"SpecialToken": {"id": t, "type_id": 0}} for t in first] + [{"Sequence": {"id": piece, "type_id": 0}}] + [
            {"SpecialToken": {"id": t, "type_id": 0}} for t in last
        ]

    return {
        "type": "TemplateProcessing",
        "single": seq("A"),
        "pair": seq("A") + seq("B"),
        "special_tokens": {t: {"id": t, "ids": i, "tokens": [t]} for t, i in ids.items()},
    }


def _gpt2_tokenizer(reader, tokens: list[str], types: list[int]) -> dict:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if not set(token) <= alphabet:  # stored as raw text: spell it in the byte alphabet
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    merges = [m.split(" ", 1) for m in _field(reader, "tokenizer.ggml.merges", [])]
    pre = str(_field(reader, "tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        log.warning("GGUF pre-tokenizer '%s' is not one we know; splitting text as GPT-2 does (tokens may differ from llama.cpp's)", pre)
    pre_tokenizers, ignore_merges = PRE_TOKENIZERS.get(pre, PRE_TOKENIZERS["default"])
    return {
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": ignore_merges,
            "vocab": vocab, "merges": merges,
        },
        "added_tokens": _added_tokens(tokens, types, alphabet),
    }


def _sentencepiece_merges(vocab: dict[str, int], scores: list[float]) -> list[list[str]]:
    """Merges implied by a SentencePiece BPE vocabulary: each token split in two vocabulary tokens,
    ordered by the merged token's score (best first), then by the pieces' ids."""
    merges = []
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[index], vocab[left], vocab[right], left, right))
    merges.sort()
    return [[left, right] for *_, left, right in merges]


# Gemma's files store a token of several spaces as real spaces, which SentencePiece spells with
# U+2581, and their scores do not follow the merge order, their token order does (as transformers'
# GGUF tokenizer converter found).
TOKEN_ORDER_MERGES = ("gemma", "gemma2", "gemma3")


def _sentencepiece_tokenizer(reader, tokens: list[str], types: list[int]) -> dict:
    scores = [float(s) for s in _field(reader, "tokenizer.ggml.scores", [0.0] * len(tokens))]
    if _field(reader, "general.architecture") in TOKEN_ORDER_MERGES:
        scores = [-float(i) for i in range(len(tokens))]
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    merges = [m.split(" ", 1) for m in _field(reader, "tokenizer.ggml.merges", [])] or _sentencepiece_merges(vocab, scores)
    prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, replace]} if prefix else replace
    decoders = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ] + ([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else [])
    return {
        "normalizer": normalizer,
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": tokens[int(unk)] if unk is not None else None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
            "ignore_merges": False, "vocab": vocab, "merges": merges,
        },
        "added_tokens": _added_tokens(tokens, types, None),
    }


BUILDERS = {"gpt2": _gpt2_tokenizer, "llama": _sentencepiece_tokenizer}


def tokenizer_files(reader, file: Path) -> tuple[str, dict, dict]:
    """(tokenizer.json text, tokenizer_config.json dict, generation_config.json dict) of a GGUF."""
    kind = _field(reader, "tokenizer.ggml.model")
    if kind not in BUILDERS:
        raise CheckpointError(
            f"'{file}' has a '{kind}' vocabulary (tokenizer.ggml.model), which this pipeline cannot convert to "
            f"tokenizer.json; supported: {', '.join(BUILDERS)}"
        )
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens", [])]
    if not tokens:
        raise CheckpointError(f"'{file}' has no vocabulary (tokenizer.ggml.tokens)")
    types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))]
    if kind == "llama" and _field(reader, "general.architecture") in TOKEN_ORDER_MERGES:
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    ids = {name: _field(reader, f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos", "padding", "unknown", "eot", "eom")}
    ids = {name: int(i) if i is not None and 0 <= int(i) < len(tokens) else None for name, i in ids.items()}
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    body = BUILDERS[kind](reader, tokens, types)
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": body.pop("added_tokens"),
        "normalizer": body["normalizer"], "pre_tokenizer": body["pre_tokenizer"],
        "post_processor": _post_processor(tokens, ids["bos"], ids["eos"], add_bos, add_eos),
        "decoder": body["decoder"], "model": body["model"],
    }

    def token(name: str) -> str | None:
        return tokens[ids[name]] if ids[name] is not None else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"), "eos_token": token("eos"), "pad_token": token("padding"), "unk_token": token("unknown"),
        "add_bos_token": add_bos, "add_eos_token": add_eos,
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    eos_ids = list(dict.fromkeys(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None))
    generation_config = {"bos_token_id": ids["bos"], "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    return json.dumps(tokenizer, ensure_ascii=False), tokenizer_config, generation_config
