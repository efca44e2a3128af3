"""prepare, the cache-I/O form of a text decoder (QNN's): the KV cache, positions and mask are
graph I/O (models/cache_io.py has the contract)."""

from __future__ import annotations

import torch
from torch import nn
from torch.export import Dim

from genai_pipeline.artifacts import GraphBundle
from genai_pipeline.errors import InputError
from genai_pipeline.models.cache_io import FORM, CacheIOContract
from genai_pipeline.models.decoder import Decoder
from genai_pipeline.names import GraphName
from genai_pipeline.options import PrepareOptions


class CacheIOGraph(nn.Module):
    """The decoder's cache-I/O form (QNN's) as one exported method: the KV cache, positions and
    mask are graph I/O (models/cache_io.py has the contract). Same wrapped decoder, same weights."""

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
    inputs = (
        torch.zeros(1, rows, dtype=torch.long),
        torch.zeros(1, rows, dtype=torch.long),
        torch.zeros(1, 1, rows, s + rows),
        cache,
        [t.clone() for t in cache],
    )
    return inputs + ((torch.zeros(1, 1, rows, s + rows),) if any(decoder.layer_windowed) else ())


def cache_io_graphs(decoder: Decoder, options: PrepareOptions) -> tuple[dict, GraphBundle, dict]:
    """The cache-I/O form: its deploy graphs (static T), its quantize graph (dynamic T, every
    row's logits) and the manifest's sections describing the I/O contract (PreparedModel fields)."""
    if decoder.config.conv_layers:
        raise InputError("the cache-I/O form carries no convolution state: export this model (LFM2) without --cache-io")
    decoder.use_cache_io()
    rows = {GraphName.PREFILL_CHUNK: options.prefill_len, GraphName.DECODE_TOKEN: 1}
    rows = {name: rows[name] for name in options.mode.graphs}
    contract = CacheIOContract.of(decoder, {name.value: n for name, n in rows.items()})
    next_token = CacheIOGraph(decoder, last_only=True)
    graphs = {name: GraphBundle(name, next_token, cache_io_example_inputs(decoder, n)) for name, n in rows.items()}
    t = Dim("rows", min=1, max=options.max_seq_len)
    per_layer = [None] * decoder.config.n_layers
    mask = {2: t, 3: t + options.max_seq_len}
    dynamic = ({1: t}, {1: t}, mask, per_layer, per_layer) + ((mask,) if any(decoder.layer_windowed) else ())
    quantize_graph = GraphBundle(
        GraphName.FORWARD,
        CacheIOGraph(decoder, last_only=False),
        cache_io_example_inputs(decoder, 2),
        dynamic_shapes=dynamic,
        metadata={"cache_io": contract},
    )
    return graphs, quantize_graph, {"decoder_form": FORM, "cache_io": contract.as_manifest()}
