"""A GGUF's vocabulary as the tokenizer.json, tokenizer_config.json and generation_config.json
a Hugging Face folder would hold.
`checkpoint_folder` writes them (and config.json) into a temporary folder that stands for the GGUF.

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

import atexit
import json
import logging
import numbers
import shutil
import tempfile
from pathlib import Path

import numpy as np

from genai_pipeline.checkpoints.gguf import config_dict, open_reader, require_gguf
from genai_pipeline.checkpoints.gguf import metadata as _field
from genai_pipeline.errors import CheckpointError

log = logging.getLogger(__name__)

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # tokenizer.ggml.token_type values (llama.cpp's)
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
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
    **{
        pre: ([DIGITS, _byte_level(True)], False) for pre in ("smollm", "starcoder", "refact", "command-r", "codeshell")
    },
    **{
        pre: ([_split(LLAMA3_SPLIT), _byte_level(False)], True)
        for pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe")
    },
    **{pre: ([_split(QWEN2_SPLIT), _byte_level(False)], False) for pre in ("qwen2", "deepseek-r1-qwen")},
}

# No normalizer, not even Qwen's NFC: llama.cpp applies none, and ExecuTorch 1.5.1's C++ NFC
# normalizer encodes "naïve" differently from `tokenizers` (tested).


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of every byte (the alphabet of byte-level vocabularies)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
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
        added.append(
            {
                "id": i,
                "content": token,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": kind == USER_DEFINED and alphabet is None,
                "special": kind == CONTROL,
            }
        )
    return added


def _post_processor(tokens: list[str], bos: int | None, eos: int | None, add_bos: bool, add_eos: bool) -> dict | None:
    """BOS/EOS the tokenizer adds itself, as tokenizer.ggml.add_bos_token / add_eos_token say."""
    first = [tokens[bos]] if add_bos and bos is not None else []
    last = [tokens[eos]] if add_eos and eos is not None else []
    if not first and not last:
        return None
    ids = {t: [tokens.index(t)] for t in first + last}

    def seq(piece: str) -> list[dict]:
        return (
            [{"SpecialToken": {"id": t, "type_id": 0}} for t in first]
            + [{"Sequence": {"id": piece, "type_id": 0}}]
            + [{"SpecialToken": {"id": t, "type_id": 0}} for t in last]
        )

    return {
        "type": "TemplateProcessing",
        "single": seq("A"),
        "pair": seq("A") + seq("B"),
        "special_tokens": {t: {"id": t, "ids": i, "tokens": [t]} for t, i in ids.items()},
    }


def _typed(reader, key: str, kind: type, default=None, of: type | None = None):
    """A vocabulary field, its type checked: `kind` (list: every item an `of`), else one line."""
    value = _field(reader, key, default)
    if value is None:
        return None

    def fits(v, t) -> bool:  # the reader's numbers may be NumPy's; a bool is no number here
        abstract = {int: numbers.Integral, float: numbers.Real}.get(t, t)
        return isinstance(v, abstract) and (t is bool or not isinstance(v, (bool, np.bool_)))

    ok = fits(value, kind) and (kind is not list or all(fits(v, of) for v in value))
    if not ok:
        expected = f"a list of {of.__name__}s" if kind is list else f"a {kind.__name__}"
        raise CheckpointError(f"GGUF metadata {key} is {str(value)[:60]!r}; expected {expected}")
    return value


def _merges(reader) -> list[list[str]]:
    merges = _typed(reader, "tokenizer.ggml.merges", list, [], str)
    pairs = [m.split(" ", 1) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise CheckpointError(
            "GGUF metadata tokenizer.ggml.merges holds an entry without a space; expected 'left right' pairs"
        )
    return pairs


def _gpt2_tokenizer(reader, tokens: list[str], types: list[int]) -> dict:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if not set(token) <= alphabet:  # stored as raw text: spell it in the byte alphabet
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    merges = _merges(reader)
    pre = str(_field(reader, "tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        log.warning(
            "GGUF pre-tokenizer '%s' is not one we know; splitting text as GPT-2 does (tokens may differ from llama.cpp's)",
            pre,
        )
    pre_tokenizers, ignore_merges = PRE_TOKENIZERS.get(pre, PRE_TOKENIZERS["default"])
    return {
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": merges,
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
    scores = [float(s) for s in _typed(reader, "tokenizer.ggml.scores", list, [0.0] * len(tokens), float)]
    if len(scores) != len(tokens):
        raise CheckpointError(
            f"GGUF metadata tokenizer.ggml.scores has {len(scores)} scores for {len(tokens)} tokens; expected one each"
        )
    if _field(reader, "general.architecture") in TOKEN_ORDER_MERGES:
        scores = [-float(i) for i in range(len(tokens))]
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    merges = _merges(reader) or _sentencepiece_merges(vocab, scores)
    prefix = bool(_typed(reader, "tokenizer.ggml.add_space_prefix", bool, True))
    unk = _typed(reader, "tokenizer.ggml.unknown_token_id", int)
    if unk is not None and not 0 <= unk < len(tokens):
        raise CheckpointError(
            f"GGUF metadata tokenizer.ggml.unknown_token_id is {unk}; expected a token id below {len(tokens)}"
        )
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    normalizer = (
        {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, replace]} if prefix else replace
    )
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
            "type": "BPE",
            "dropout": None,
            "unk_token": tokens[unk] if unk is not None else None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
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
    tokens = _typed(reader, "tokenizer.ggml.tokens", list, [], str)
    if not tokens:
        raise CheckpointError(f"'{file}' has no vocabulary (tokenizer.ggml.tokens)")
    types = _typed(reader, "tokenizer.ggml.token_type", list, [1] * len(tokens), int)
    if len(types) != len(tokens):
        raise CheckpointError(
            f"GGUF metadata tokenizer.ggml.token_type has {len(types)} types for {len(tokens)} tokens; expected one each"
        )
    if kind == "llama" and _field(reader, "general.architecture") in TOKEN_ORDER_MERGES:
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    ids = {
        name: _typed(reader, f"tokenizer.ggml.{name}_token_id", int)
        for name in ("bos", "eos", "padding", "unknown", "eot", "eom")
    }
    ids = {name: int(i) if i is not None and 0 <= i < len(tokens) else None for name, i in ids.items()}
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise
    add_bos = bool(_typed(reader, "tokenizer.ggml.add_bos_token", bool, kind == "llama"))
    add_eos = bool(_typed(reader, "tokenizer.ggml.add_eos_token", bool, False))
    body = BUILDERS[kind](reader, tokens, types)
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": body.pop("added_tokens"),
        "normalizer": body["normalizer"],
        "pre_tokenizer": body["pre_tokenizer"],
        "post_processor": _post_processor(tokens, ids["bos"], ids["eos"], add_bos, add_eos),
        "decoder": body["decoder"],
        "model": body["model"],
    }

    def token(name: str) -> str | None:
        return tokens[ids[name]] if ids[name] is not None else None

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "chat_template": _typed(reader, "tokenizer.chat_template", str),
    }
    eos_ids = list(dict.fromkeys(i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None))
    generation_config = {"bos_token_id": ids["bos"], "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    return json.dumps(tokenizer, ensure_ascii=False), tokenizer_config, generation_config


# -- the Hugging Face files a GGUF stands for ----------------------------------------------------

_FOLDERS: dict[tuple[str, float], Path] = {}


def checkpoint_folder(path: Path) -> Path:
    """A folder (temporary, owned by this process, removed at exit) holding the Hugging Face
    metadata files of a GGUF: config.json, tokenizer.json, tokenizer_config.json,
    generation_config.json. No weights. Written once per file per process."""
    file = require_gguf(path)
    key = (str(file.resolve()), file.stat().st_mtime if file.is_file() else 0.0)
    if key in _FOLDERS and _FOLDERS[key].is_dir():
        return _FOLDERS[key]
    reader = open_reader(file)
    config = config_dict(reader, file)
    tokenizer, tokenizer_config, generation_config = tokenizer_files(reader, file)
    folder = Path(tempfile.mkdtemp(prefix=f"genai-gguf-{file.stem[:40]}-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "tokenizer.json").write_text(tokenizer, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False), encoding="utf-8"
    )
    (folder / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    _FOLDERS[key] = folder
    return folder
