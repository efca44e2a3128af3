"""prepare, what the text and the vision-language paths share: the runners' metadata methods and
the checks of a checkpoint against the export's options."""

from __future__ import annotations

import json
import os
from pathlib import Path

from genai_pipeline.errors import CheckpointError, InputError
from genai_pipeline.registry import ModelSpec


def decoder_constants(spec: ModelSpec, config, max_seq_len: int, max_prefill: int) -> dict:
    """ExecuTorch's LLM metadata methods, which its runners read (the context, the special tokens).
    `max_prefill`: the most tokens one call of the program's prefill method (`forward`, `prefill`,
    `text_decoder`) takes, any number up to it; 0: no such method."""
    return {
        # TextLLMRunner sends a longer prompt in chunks of this many tokens; without a method of
        # any length, it prefills token by token (enable_dynamic_shape)
        "get_max_seq_len": max_prefill or max_seq_len,
        "get_max_context_len": max_seq_len,  # the KV cache
        "get_vocab_size": config.vocab_size,
        "get_n_layers": config.n_layers,
        "get_bos_id": spec.bos_id if spec.bos_id is not None else -1,
        "get_eos_ids": list(spec.eos_ids),
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": True,
        "enable_dynamic_shape": max_prefill > 0,
    }


def check_kv_cache_fits(config, max_seq_len: int) -> None:
    """Refuse, before anything is allocated, a --max-seq-len whose float KV cache alone would take
    more than half of this machine's memory (the export holds the model and its graphs beside it)."""
    cache = 2 * config.n_layers * max_seq_len * config.n_kv_heads * config.head_dim * 4
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if cache > memory / 2:
        raise InputError(
            f"--max-seq-len {max_seq_len} needs a KV cache of {cache / 2**30:,.1f} GiB, more than half of this "
            f"machine's {memory / 2**30:.1f} GiB of memory; lower --max-seq-len"
        )


def check_vocabulary(rows: int, tokenizer: Path | None, special) -> None:
    """Every id the program may be fed or asked to stop on has a row in the embedding: a special id
    or a tokenizer.json id past the rows would fail only at run time, deep in the runtime."""
    named = [("bos_id", special.bos_id), *(("eos_ids", i) for i in special.eos_ids), ("pad_id", special.pad_id)]
    for name, token in named:
        if token is not None and not 0 <= token < rows:
            where = ", ".join(special.sources.get(name, ())) or "the registry entry"
            raise CheckpointError(
                f"the checkpoint's {name.rstrip('s').removesuffix('_id')} token id {token} (from {where}) is past "
                f"its {rows} embedding rows; the checkpoint is inconsistent"
            )
    if tokenizer is not None and tokenizer.name == "tokenizer.json":
        try:
            data = json.loads(tokenizer.read_text(encoding="utf-8"))
            vocab = (data.get("model") or {}).get("vocab") or {}
            ids = [
                *(vocab.values() if isinstance(vocab, dict) else ()),
                *(t.get("id") for t in data.get("added_tokens") or ()),
            ]
            top = max((i for i in ids if isinstance(i, int)), default=-1)
        except (ValueError, AttributeError, TypeError):
            return  # the tokenizer's own reader says what is wrong with it, where it is read
        if top >= rows:
            raise CheckpointError(
                f"'{tokenizer}' has token ids up to {top}, past the model's {rows} embedding rows; "
                "the tokenizer does not belong to these weights"
            )
