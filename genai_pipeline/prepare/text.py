"""prepare, for a text entry: the decoder (+ optional local checkpoint) -> the graphs of its program."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from torch import nn
from torch.export import Dim

from genai_pipeline.artifacts import Artifact, GraphBundle, PreparedModel
from genai_pipeline.chat_template import read_chat_template
from genai_pipeline.checkpoints import load_decoder, metadata_folder, open_decoder
from genai_pipeline.checkpoints.hf import random_decoder
from genai_pipeline.checkpoints.special_tokens import read_special_tokens
from genai_pipeline.models.decoder import Decoder
from genai_pipeline.names import ArtifactKey, GraphName, Mode
from genai_pipeline.options import PrepareOptions
from genai_pipeline.prepare.cache_io import cache_io_graphs
from genai_pipeline.prepare.common import check_vocabulary, decoder_constants
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


def _graphs(decoder: Decoder, options: PrepareOptions) -> dict[GraphName, GraphBundle]:
    pos = torch.tensor([0], dtype=torch.long)

    def tokens(n: int) -> torch.Tensor:
        return torch.zeros((1, n), dtype=torch.long)

    # Every graph returns only the next-token logits: the LM head is the widest layer, and a
    # prefill chunk's other rows would be computed to be thrown away (see DecoderSession.prefill
    # for a padded last chunk).
    next_token = DecoderGraph(decoder, last_only=True)
    graphs = {
        GraphName.PREFILL_CHUNK: GraphBundle(GraphName.PREFILL_CHUNK, next_token, (tokens(options.prefill_len), pos)),
        GraphName.DECODE_TOKEN: GraphBundle(GraphName.DECODE_TOKEN, next_token, (tokens(1), pos)),
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
        graphs[GraphName.PREFILL] = GraphBundle(
            GraphName.PREFILL,
            next_token,
            (tokens(2), pos),
            dynamic_shapes=({1: Dim("chunk", min=1, max=options.long_prefill)}, None),
        )
    if options.verify_len:
        # Lookahead decoding checks drafted tokens in one call and needs the logits at every one
        # of them. Same wrapped decoder: the weights and the KV cache stay shared with the others.
        # Any length up to its own, so a call costs what its rows cost (not all N's): the drafter
        # sizes its drafts by those costs (runtime/lookahead.py).
        every_row = DecoderGraph(decoder, last_only=False)
        graphs[GraphName.VERIFY] = GraphBundle(
            GraphName.VERIFY,
            every_row,
            (tokens(2), pos),
            dynamic_shapes=({1: Dim("drafts", min=1, max=options.verify_len)}, None),
        )
    return graphs


def prepare_text(spec: ModelSpec, options: PrepareOptions, lazy: bool = False) -> PreparedModel:
    checkpoint = options.checkpoint or spec.checkpoint
    if checkpoint is not None:
        log.info("loading %s from %s", spec.name, checkpoint)
        if lazy:
            decoder, loader = open_decoder(spec, Path(checkpoint), options.max_seq_len)
        else:
            decoder, loader = load_decoder(spec, Path(checkpoint), options.max_seq_len), None
        weights = str(checkpoint)
    else:
        log.warning(
            "%s: no checkpoint given, using RANDOM weights (seed %d); pass --checkpoint DIR for real weights",
            spec.name,
            options.seed,
        )
        decoder, loader = random_decoder(spec.config, options.max_seq_len, options.seed), None
        weights = "random"
    config = decoder.config
    if checkpoint is not None and checkpoint != spec.checkpoint:
        spec = sized_as(spec, config)  # a checkpoint of other sizes is not exported under this entry's name
    if options.max_seq_len > config.max_position_embeddings:
        log.warning(
            "--max-seq-len %d exceeds the model's trained context %d",
            options.max_seq_len,
            config.max_position_embeddings,
        )
    metadata = metadata_folder(Path(checkpoint)) if checkpoint is not None else None
    tokenizer = find_tokenizer_file(metadata) if metadata is not None else None
    if tokenizer is not None and (kind := tokenizer_kind(tokenizer)) is not spec.tokenizer_kind:
        log.warning(
            "%s: %s is %s, but this entry's checkpoints carry %s; check that the tokenizer belongs to the model",
            spec.name,
            tokenizer,
            kind.value,
            spec.tokenizer_kind.value,
        )
    template = read_chat_template(metadata) if metadata is not None else None
    special = read_special_tokens(
        metadata,
        template.source if template else spec.chat_template,
        spec.bos_id,
        spec.eos_ids,
        origin="" if metadata is None or metadata == Path(checkpoint) else f"{Path(checkpoint).name} metadata as ",
    )
    check_vocabulary(config.vocab_size, tokenizer, special)
    # The checkpoint's own bos/eos, the entry filling only what it lacks, for every reader downstream.
    spec = dataclasses.replace(spec, bos_id=special.bos_id, eos_ids=special.eos_ids)
    max_prefill = options.max_seq_len if options.mode is Mode.DYNAMIC else options.long_prefill
    constants = decoder_constants(spec, config, options.max_seq_len, max_prefill)
    if options.mode is Mode.HYBRID:
        constants["get_prefill_len"] = options.prefill_len
    sections = {}  # the manifest's decoder_form and cache_io, for the cache-I/O form
    if options.cache_io:
        graphs, quantize_graph, sections = cache_io_graphs(decoder, options)
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
        loader=loader,
        **sections,
    )
