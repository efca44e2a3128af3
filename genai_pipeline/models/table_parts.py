"""A tied token table in two parts: its first rows and the rest, each an embedding for the lookup and
a linear for the LM head, so that a recipe can store the two parts at different precisions (the
table's first rows at 8 bits under 8da4w: quantize/recipes.py).

The parts compute the same function as the whole table: the lookup takes each id's row from the
part that holds it, the head concatenates the parts' logits in id order. Tied, each head part reads
its lookup part's storage (one table in memory, as Decoder.tie_weights keeps it)."""

from __future__ import annotations

import torch
from torch import nn


class TableLookup(nn.Module):
    """ids [...] -> rows [..., dim] of a table held as `first` (ids < rows) and `rest` (the others)."""

    def __init__(self, first: nn.Module, rest: nn.Module, rows: int):
        super().__init__()
        self.first, self.rest, self.rows = first, rest, rows

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Both parts are read at every position (clamped into range) and the right row kept: a
        # gather per part and a select, no shape that depends on the ids.
        first = self.first(tokens.clamp(max=self.rows - 1))
        rest = self.rest((tokens - self.rows).clamp(min=0))
        return torch.where((tokens < self.rows).unsqueeze(-1), first, rest)


class TableHead(nn.Module):
    """hidden [..., dim] -> logits [..., vocab]: the `first` part's logits, then the `rest`'s."""

    def __init__(self, first: nn.Linear, rest: nn.Linear):
        super().__init__()
        self.first, self.rest = first, rest

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.first(h), self.rest(h)], dim=-1)


def split_table(decoder: nn.Module, rows: int) -> None:
    """`decoder`'s tied, float token table and LM head (tok_embeddings, output) as TableLookup and
    TableHead of its first `rows` rows and the rest, in place; each head part reads its lookup part's
    storage. Names after: tok_embeddings.first / .rest, output.first / .rest."""
    table = decoder.tok_embeddings.weight.detach()
    vocab, dim = table.shape
    if not 0 < rows < vocab:
        raise ValueError(f"a table of {vocab} rows splits after 1 to {vocab - 1} rows, not {rows}")
    parts = table[:rows], table[rows:]
    lookups = [nn.Embedding.from_pretrained(p) for p in parts]  # frozen, on the table's storage
    heads = [nn.Linear(dim, len(p), bias=False, device="meta") for p in parts]
    for head, part in zip(heads, parts):
        head.weight = nn.Parameter(part, requires_grad=False)
    decoder.tok_embeddings = TableLookup(*lookups, rows)
    decoder.output = TableHead(*heads)
