"""The cache-I/O form of the decoder (QNN's form, `Decoder.forward_cache_io`): its I/O contract, and
the driver that follows it. The KV cache lives in buffers the runtime owns, every call gets the past
rows, the positions and an attention mask as inputs, and returns this call's new rows, which the
runtime writes into its buffers at the cursor. A device runner does the same with the contract the
manifest records (`CacheIOContract.as_manifest()`); the runtime's session (runtime/cache_io.py) and
static calibration (quantize/static.py) drive the graphs through `CacheIODriver`, so that both see
the inputs a device gives.

One call of a method taking T tokens, with n real tokens (n <= T) at cursor `pos`:
- tokens `[1, T]`: the n real tokens LEFT-padded with 0s, so that the last row, whose logits the
  method returns, is the last real token (no call is wasted on re-feeding it);
- positions `[1, T]`: pos, pos + 1, ... for the real rows; padding rows repeat `pos`;
- mask `[1, 1, T, S + T]` (S = max_seq_len): columns 0..S-1 are the cache rows, S..S+T-1 this
  call's rows; a real row sees the cache rows before `pos` and the real rows up to itself, a
  padding row sees only itself (a row that sees nothing would be NaN); 0 seen, MASK_HIDDEN hidden;
- window_mask, the same for sliding-window layers, which also hide what lies `sliding_window`
  or more positions back (only for models with such layers);
- k_past / v_past: the runtime's buffers as they are, `[1, n_kv_heads, S, head_dim]` per layer;
- outputs: logits `[1, vocab]`, then k_new and v_new `[1, n_kv_heads, T, head_dim]` per layer;
  rows T - n .. T - 1 (the real ones) are written at cache rows pos .. pos + n - 1.
Cache rows at and past `pos` are never seen, so a cursor moved back truncates the cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from genai_pipeline.models.decoder import MASK_HIDDEN
from genai_pipeline.names import GraphName, method_names

FORM = "cache-io"  # the manifest's `decoder_form` of a program in this form


@dataclass(frozen=True)
class CacheIOContract:
    """What a runtime needs to know to drive a program in the cache-I/O form."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    max_seq_len: int
    tokens_per_call: Mapping[str, int]  # method -> T: prefill_chunk -> --prefill-len, decode_token -> 1
    sliding_window: int | None = None  # set when some layers attend through a window (a window_mask input)

    def as_manifest(self) -> dict:
        """The manifest's `cache_io`: the I/O contract in numbers (read back by from_manifest) and words."""
        s, cache = self.max_seq_len, f"[1, {self.n_kv_heads}, {self.max_seq_len}, {self.head_dim}]"
        inputs = [
            "tokens int64 [1, T]",
            "positions int64 [1, T]",
            f"mask float32 [1, 1, T, {s} + T]",
            f"k_past float32 {cache} x {self.n_layers} layers",
            f"v_past float32 {cache} x {self.n_layers} layers",
        ]
        if self.sliding_window is not None:
            inputs.append(f"window_mask float32 [1, 1, T, {s} + T] (sliding window {self.sliding_window})")
        return {
            **dataclasses.asdict(self),
            "inputs": inputs,
            "outputs": [
                "logits float32 [1, vocab] (after the last row)",
                f"k_new float32 [1, {self.n_kv_heads}, T, {self.head_dim}] x {self.n_layers} layers",
                f"v_new float32 [1, {self.n_kv_heads}, T, {self.head_dim}] x {self.n_layers} layers",
            ],
            "cache": f"the runtime's buffers, k and v {cache} per layer (heads, rows, head dim), passed whole; "
            "rows at and past the cursor are hidden by the mask",
            "padding": "a call of n < T tokens is left-padded with token 0; padding rows take position = cursor",
            "positions": "each row's position in the sequence; RoPE rows are gathered by it",
            "mask": f"additive, 0 seen / {MASK_HIDDEN} hidden; columns 0..{s - 1} are cache rows, {s}..{s}+T-1 this "
            "call's rows; a real row sees cache rows before the cursor and real rows up to itself, a padding "
            "row only itself"
            + (
                "; window_mask also hides rows sliding_window or more positions back"
                if self.sliding_window is not None
                else ""
            ),
            "cache_update": "the real rows of k_new / v_new (the last n) are written at cache rows cursor..cursor+n-1",
            "mask_hidden": MASK_HIDDEN,
        }

    @classmethod
    def from_manifest(cls, manifest) -> CacheIOContract | None:
        """The contract of an export (its manifest.Manifest) in the cache-I/O form; None for the other form."""
        if manifest.decoder_form != FORM:
            return None
        recorded = dict(manifest.cache_io)
        # Keyed by graph: an export from before the rename calls the methods otherwise (names.method_names).
        graphs = {name: graph.value for graph, name in method_names(recorded["tokens_per_call"]).items()}
        recorded["tokens_per_call"] = {graphs.get(m, m): n for m, n in recorded["tokens_per_call"].items()}
        return cls(**{f.name: recorded[f.name] for f in dataclasses.fields(cls)})

    @classmethod
    def of(cls, decoder, tokens_per_call: Mapping[str, int]) -> CacheIOContract:
        c = decoder.config
        window = c.sliding_window if any(decoder.layer_windowed) else None
        return cls(c.n_layers, c.n_kv_heads, c.head_dim, decoder.max_seq_len, dict(tokens_per_call), window)

    def call_inputs(self, tokens: list[int], pos: int, rows: int, k_cache: list, v_cache: list) -> list[torch.Tensor]:
        """The flat inputs of one call of a method taking `rows` tokens (see the module doc)."""
        n, s = len(tokens), self.max_seq_len
        pad = rows - n
        ids = torch.tensor([[0] * pad + list(tokens)], dtype=torch.long)
        positions = torch.tensor([[pos] * pad + list(range(pos, pos + n))], dtype=torch.long)
        row = torch.arange(rows)[:, None]  # this call's row i
        new = torch.arange(rows)[None, :]  # this call's column t
        real_row = row >= pad
        sees_new = torch.where(real_row, (new >= pad) & (new <= row), new == row)
        sees_past = real_row & (torch.arange(s)[None, :] < pos)
        inputs = [ids, positions, self._additive(torch.cat([sees_past, sees_new], dim=1))]
        inputs += [*k_cache, *v_cache]
        if self.sliding_window is not None:
            # Position of every column: cache row j is position j; this call's column t is its position.
            column_pos = torch.cat([torch.arange(s), positions[0]])
            in_window = column_pos[None, :] > positions[0][:, None] - self.sliding_window
            inputs.append(self._additive(torch.cat([sees_past, sees_new], dim=1) & in_window))
        return inputs

    @staticmethod
    def _additive(seen: torch.Tensor) -> torch.Tensor:
        return torch.where(seen, 0.0, MASK_HIDDEN).to(torch.float32)[None, None]


# A method by name, run on flat inputs -> flat outputs (a program's method, or an eager graph).
Runner = Callable[[GraphName, list], list]


class CacheIODriver:
    """The KV cache buffers a runtime keeps for one sequence, and the calls that feed it: each call
    takes up to its method's T tokens at a position, and its new rows are written there."""

    def __init__(self, contract: CacheIOContract, run: Runner):
        self.contract, self.run = contract, run
        shape = (1, contract.n_kv_heads, contract.max_seq_len, contract.head_dim)
        self.k_cache = [torch.zeros(shape) for _ in range(contract.n_layers)]
        self.v_cache = [torch.zeros(shape) for _ in range(contract.n_layers)]

    def call(self, method: GraphName, tokens: list[int], pos: int) -> torch.Tensor:
        """One call of `method` on `tokens` at `pos`; the logits after the last of them, [vocab]."""
        c, n = self.contract, len(tokens)
        rows = c.tokens_per_call[method.value]
        outputs = self.run(method, c.call_inputs(tokens, pos, rows, self.k_cache, self.v_cache))
        logits, k_new, v_new = outputs[0], outputs[1 : 1 + c.n_layers], outputs[1 + c.n_layers : 1 + 2 * c.n_layers]
        for cache, new in zip((*self.k_cache, *self.v_cache), (*k_new, *v_new)):
            cache[:, :, pos : pos + n] = new[:, :, rows - n :]
        return logits.reshape(-1, logits.shape[-1])[-1].clone()

    def feed(self, tokens: list[int], pos: int) -> torch.Tensor:
        """`tokens` at `pos` in chunks of the prefill length (the last one left-padded, or through
        `decode_token` if it is one token), or one `decode_token` call each without a prefill method;
        the logits after the last of them, [vocab]."""
        chunk = self.contract.tokens_per_call.get(GraphName.PREFILL_CHUNK.value, 1)
        for i in range(0, len(tokens), chunk):
            part = tokens[i : i + chunk]
            logits = self.call(GraphName.DECODE_TOKEN if len(part) == 1 else GraphName.PREFILL_CHUNK, part, pos + i)
        return logits


def eager_runner(graphs: Mapping[GraphName, torch.nn.Module], n_layers: int) -> Runner:
    """The cache-I/O graphs (prepare.CacheIOGraph, or their calibrated QDQ modules) run in eager:
    the flat inputs regrouped as the graphs take them (tokens, positions, mask, k_past list,
    v_past list, window_mask)."""

    def run(method: GraphName, inputs: list) -> list:
        tokens, positions, mask = inputs[:3]
        k_past, v_past, rest = (
            inputs[3 : 3 + n_layers],
            inputs[3 + n_layers : 3 + 2 * n_layers],
            inputs[3 + 2 * n_layers :],
        )
        with torch.no_grad():
            logits, k_new, v_new = graphs[method](tokens, positions, mask, list(k_past), list(v_past), *rest)
        return [logits, *k_new, *v_new]

    return run
