"""prepare: a registry entry (+ optional local checkpoint) -> the graphs of each artifact."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import torch
from torch import nn
from torch.export import Dim

from genai_pipeline.artifacts import Artifact, GraphBundle, PreparedModel
from genai_pipeline.chat_template import read_chat_template
from genai_pipeline.checkpoints import load_decoder, metadata_folder
from genai_pipeline.checkpoints.hf import random_decoder
from genai_pipeline.checkpoints.special_tokens import read_special_tokens
from genai_pipeline.errors import CheckpointError, InputError
from genai_pipeline.models.decoder import Decoder
from genai_pipeline.names import ArtifactKey, GraphName, Mode
from genai_pipeline.options import PrepareOptions
from genai_pipeline.registry import ModelSpec, sized_as
from genai_pipeline.tokenizer import find_tokenizer_file, tokenizer_kind

log = logging.getLogger(__name__)


class DecoderGraph(nn.Module):
    """The decoder as one exported method. Every graph of a program wraps the same decoder the
    same way, so their weights and KV-cache buffers carry the same names and are shared."""

    def __init__(self, decoder: Decoder, last_only: bool):
        super().__init__()
        self.decoder, self.last_only = decoder, last_only

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.decoder(tokens, input_pos, last_only=self.last_only)


class CacheIOGraph(nn.Module):
    """The decoder's cache-I/O form (QNN's) as one exported method: the KV cache, positions and
    mask are graph I/O (runtime/cache_io.py has the contract). Same wrapped decoder, same weights."""

    def __init__(self, decoder: Decoder, last_only: bool = True):
        super().__init__()
        self.decoder, self.last_only = decoder, last_only

    def forward(self, tokens, positions, mask, k_past: list, v_past: list, window_mask=None):
        return self.decoder.forward_cache_io(tokens, positions, mask, window_mask, k_past, v_past, self.last_only)


def cache_io_example_inputs(decoder: Decoder, rows: int) -> tuple:
    """Example inputs of a cache-I/O graph taking `rows` tokens per call (window_mask only for a
    model with sliding-window layers)."""
    c, s = decoder.config, decoder.max_seq_len
    cache = [torch.zeros(1, c.n_kv_heads, s, c.head_dim) for _ in range(c.n_layers)]
    inputs = (torch.zeros(1, rows, dtype=torch.long), torch.zeros(1, rows, dtype=torch.long),
              torch.zeros(1, 1, rows, s + rows), cache, [t.clone() for t in cache])
    return inputs + ((torch.zeros(1, 1, rows, s + rows),) if any(decoder.layer_windowed) else ())


def _graphs(decoder: Decoder, options: PrepareOptions) -> dict[GraphName, GraphBundle]:
    pos = torch.tensor([0], dtype=torch.long)

    def tokens(n: int) -> torch.Tensor:
        return torch.zeros((1, n), dtype=torch.long)

    # Every graph returns only the next-token logits: the LM head is the widest layer, and a
    # prefill chunk's other rows would be computed to be thrown away (see DecoderSession.prefill
    # for a padded last chunk).
    next_token = DecoderGraph(decoder, last_only=True)
    graphs = {
        GraphName.PREFILL: GraphBundle(GraphName.PREFILL, next_token, (tokens(options.prefill_len), pos)),
        GraphName.DECODE: GraphBundle(GraphName.DECODE, next_token, (tokens(1), pos)),
        GraphName.FORWARD: GraphBundle(
            GraphName.FORWARD,
            next_token,
            (tokens(2), pos),
            dynamic_shapes=({1: Dim("seq_len", min=1, max=options.max_seq_len)}, None),
        ),
    }
    graphs = {name: graphs[name] for name in options.mode.graphs}
    if options.long_prefill:
        # Any length up to its own: a prompt's tail or a short chat turn in one call, no padding
        # (padded static chunks cost short prompts much of dynamic's prefill speed: docs/decisions/0022)
        graphs[GraphName.PREFILL_LONG] = GraphBundle(
            GraphName.PREFILL_LONG, next_token, (tokens(2), pos),
            dynamic_shapes=({1: Dim("chunk", min=1, max=options.long_prefill)}, None))
    if options.verify_len:
        # Lookahead decoding checks drafted tokens in one call and needs the logits at every one
        # of them. Same wrapped decoder: the weights and the KV cache stay shared with the others.
        # Any length up to its own, so a call costs what its rows cost (not all N's): the drafter
        # sizes its drafts by those costs (runtime/lookahead.py).
        every_row = DecoderGraph(decoder, last_only=False)
        graphs[GraphName.VERIFY] = GraphBundle(GraphName.VERIFY, every_row, (tokens(2), pos),
                                               dynamic_shapes=({1: Dim("drafts", min=1, max=options.verify_len)}, None))
    return graphs


def _cache_io_graphs(decoder: Decoder, options: PrepareOptions) -> tuple[dict, GraphBundle, dict]:
    """The cache-I/O form: its deploy graphs (static T), its quantize graph (dynamic T, every
    row's logits) and the manifest's description of the I/O contract."""
    from genai_pipeline.runtime.cache_io import FORM, CacheIOContract

    decoder.use_cache_io()
    rows = {GraphName.PREFILL: options.prefill_len, GraphName.DECODE: 1}
    rows = {name: rows[name] for name in options.mode.graphs}
    contract = CacheIOContract.of(decoder, {name.value: n for name, n in rows.items()})
    next_token = CacheIOGraph(decoder, last_only=True)
    graphs = {name: GraphBundle(name, next_token, cache_io_example_inputs(decoder, n)) for name, n in rows.items()}
    t = Dim("rows", min=1, max=options.max_seq_len)
    per_layer = [None] * decoder.config.n_layers
    mask = {2: t, 3: t + options.max_seq_len}
    dynamic = ({1: t}, {1: t}, mask, per_layer, per_layer) + ((mask,) if any(decoder.layer_windowed) else ())
    quantize_graph = GraphBundle(GraphName.FORWARD, CacheIOGraph(decoder, last_only=False), cache_io_example_inputs(decoder, 2),
                                 dynamic_shapes=dynamic, metadata={"cache_io": contract})
    return graphs, quantize_graph, {"decoder_form": FORM, "cache_io": contract.as_manifest()}


def decoder_constants(spec: ModelSpec, config, max_seq_len: int, dynamic: bool) -> dict:
    """ExecuTorch's LLM metadata methods, which its runners read (the context, the special tokens)."""
    return {
        "get_max_seq_len": max_seq_len,
        "get_max_context_len": max_seq_len,
        "get_vocab_size": config.vocab_size,
        "get_n_layers": config.n_layers,
        "get_bos_id": spec.bos_id if spec.bos_id is not None else -1,
        "get_eos_ids": list(spec.eos_ids),
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": True,
        "enable_dynamic_shape": dynamic,
    }


def check_kv_cache_fits(config, max_seq_len: int) -> None:
    """Refuse, before anything is allocated, a --max-seq-len whose float KV cache alone would take
    more than half of this machine's memory (the export holds the model and its graphs beside it)."""
    cache = 2 * config.n_layers * max_seq_len * config.n_kv_heads * config.head_dim * 4
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if cache > memory / 2:
        raise InputError(f"--max-seq-len {max_seq_len} needs a KV cache of {cache / 2**30:,.1f} GiB, more than half of this "
                         f"machine's {memory / 2**30:.1f} GiB of memory; lower --max-seq-len")


def check_vocabulary(rows: int, tokenizer: Path | None, special) -> None:
    """Every id the program may be fed or asked to stop on has a row in the embedding: a special id
    or a tokenizer.json id past the rows would fail only at run time, deep in the runtime."""
    named = [("bos_id", special.bos_id), *(("eos_ids", i) for i in special.eos_ids), ("pad_id", special.pad_id)]
    for name, token in named:
        if token is not None and not 0 <= token < rows:
            where = ", ".join(special.sources.get(name, ())) or "the registry entry"
            raise CheckpointError(f"the checkpoint's {name.rstrip('s').removesuffix('_id')} token id {token} (from {where}) is past "
                                  f"its {rows} embedding rows; the checkpoint is inconsistent")
    if tokenizer is not None and tokenizer.name == "tokenizer.json":
        try:
            data = json.loads(tokenizer.read_text(encoding="utf-8"))
            vocab = (data.get("model") or {}).get("vocab") or {}
            ids = [*(vocab.values() if isinstance(vocab, dict) else ()), *(t.get("id") for t in data.get("added_tokens") or ())]
            top = max((i for i in ids if isinstance(i, int)), default=-1)
        except (ValueError, AttributeError, TypeError):
            return  # the tokenizer's own reader says what is wrong with it, where it is read
        if top >= rows:
            raise CheckpointError(f"'{tokenizer}' has token ids up to {top}, past the model's {rows} embedding rows; "
                                  "the tokenizer does not belong to these weights")


def prepare(spec: ModelSpec, options: PrepareOptions) -> PreparedModel:
    check_kv_cache_fits(spec.config, options.max_seq_len)
    if spec.vision is not None:  # a vision-language model: its own module (components, one program)
        if options.cache_io:
            raise InputError(f"{spec.name} is a vision-language model: the cache-I/O form (--cache-io, --target qnn) is built for text decoders only so far")
        from genai_pipeline.prepare_multimodal import prepare_multimodal

        return prepare_multimodal(spec, options)
    if options.split:
        raise InputError(f"--split applies to vision-language models only; {spec.name} is a text-only model (its export is one program already)")
    checkpoint = options.checkpoint or spec.checkpoint
    if checkpoint is not None:
        log.info("loading %s from %s", spec.name, checkpoint)
        decoder = load_decoder(spec, Path(checkpoint), options.max_seq_len)
        weights = str(checkpoint)
    else:
        log.warning(
            "%s: no checkpoint given, using RANDOM weights (seed %d); pass --checkpoint DIR for real weights",
            spec.name, options.seed,
        )
        decoder = random_decoder(spec.config, options.max_seq_len, options.seed)
        weights = "random"
    config = decoder.config
    if checkpoint is not None and checkpoint != spec.checkpoint:
        spec = sized_as(spec, config)  # a checkpoint of other sizes is not exported under this entry's name
    if options.max_seq_len > config.max_position_embeddings:
        log.warning("--max-seq-len %d exceeds the model's trained context %d", options.max_seq_len, config.max_position_embeddings)
    metadata = metadata_folder(Path(checkpoint)) if checkpoint is not None else None
    tokenizer = find_tokenizer_file(metadata) if metadata is not None else None
    if tokenizer is not None and (kind := tokenizer_kind(tokenizer)) is not spec.tokenizer_kind:
        log.warning(
            "%s: %s is %s, but this entry's checkpoints carry %s; check that the tokenizer belongs to the model",
            spec.name, tokenizer, kind.value, spec.tokenizer_kind.value,
        )
    template = read_chat_template(metadata) if metadata is not None else None
    special = read_special_tokens(
        metadata, template.source if template else spec.chat_template, spec.bos_id, spec.eos_ids,
        origin="" if metadata is None or metadata == Path(checkpoint) else f"{Path(checkpoint).name} metadata as ",
    )
    check_vocabulary(config.vocab_size, tokenizer, special)
    # The checkpoint's own bos/eos, the entry filling only what it lacks, for every reader downstream.
    spec = dataclasses.replace(spec, bos_id=special.bos_id, eos_ids=special.eos_ids)
    constants = decoder_constants(spec, config, options.max_seq_len, dynamic=options.mode is Mode.DYNAMIC)
    if options.mode is Mode.HYBRID:
        constants["get_prefill_len"] = options.prefill_len
    extra = {}
    if options.cache_io:
        graphs, quantize_graph, extra = _cache_io_graphs(decoder, options)
        constants["use_sdpa_with_kv_cache"] = False  # plain attention; the cache is graph I/O
    else:
        graphs = _graphs(decoder, options)
        quantize_graph = GraphBundle(
            GraphName.FORWARD,
            DecoderGraph(decoder, last_only=False),
            (torch.zeros((1, 2), dtype=torch.long), torch.tensor([0], dtype=torch.long)),
            dynamic_shapes=({1: Dim("seq_len", min=1, max=options.max_seq_len)}, None),
        )
    artifact = Artifact(ArtifactKey.TEXT_DECODER, decoder, graphs, constants, quantize_graph)
    return PreparedModel(
        spec=spec,
        config=config,
        artifacts={artifact.key: artifact},
        options=options,
        weights=weights,
        tokenizer_file=tokenizer,
        special_tokens=special,
        manifest_extra=extra,
    )
