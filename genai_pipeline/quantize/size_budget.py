"""size_budget: which linear layers of a 4-bit recipe keep 8 bits, from measured sensitivity under
a byte budget (`--size-budget MB`).

The candidates are the linears of the decoder's blocks that the recipe would store at 4 bits, in
groups of one kind (wq, ..., w2) over a band of adjacent blocks (layer_groups). With every
candidate at its 4-bit values (those the export stores: gptq's, or the weight rule's), a group's
gain is how much the KL divergence of the model's next-token distribution from the float model's
falls when that group alone takes 8-bit values, on calibration text that GPTQ did not fit (on the
text it fitted, w2's 4-bit loss measured far below its loss elsewhere; docs/decisions/0021). Groups are
then promoted greedily by gain per byte until the program's estimated size reaches the budget, as
rules before the recipe's (recipes.rules_for); the recipe's own 8-bit rules of the blocks (wv, w2, the
edge layers' w1 / w3) are then left out: the measurement replaces them. A tied table at 4 bits
(recipes.table_splits) is measured at its 4-bit values too, and its first rows are candidates beside
the groups, in chunks (table_chunks) promoted in id order: what it keeps at 8 bits is a number of first
rows (recipes.table_8bit_rows), in place of the recipe's fixed share. The weights' bytes are
estimated as the program stores them (program_bytes); what the graphs and delegate payloads add is
bounded by graph_bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

import torch
from torch import nn

from genai_pipeline.artifacts import PreparedModel
from genai_pipeline.data import iterate_with_progress
from genai_pipeline.errors import InputError
from genai_pipeline.options import QuantOptions
from genai_pipeline.quantize.calibration import held_out_tokens
from genai_pipeline.quantize.recipes import HEAD, LOOKUP, linear_recipes, table_splits
from genai_pipeline.quantize.weights import RULES, linear_bytes, torchao_qparams

log = logging.getLogger(__name__)

# What a program holds beside its weights (graphs, delegate payloads), by block and method: 8da4w
# programs hold more than program_bytes counts by 94 KB (the reference model, 4 blocks, 2 methods),
# 135 KB (4 blocks, 3 methods), 618 KB (SmolLM2-135M, 30 blocks, 2 methods), 903 KB (30 blocks, 3)
GRAPH_BYTES_PER_BLOCK_AND_METHOD = 12_000
GRAPH_BYTES = 32_000
SENSITIVITY_WINDOW = 512  # tokens per run from position 0
# The head's logits scored per window, at most: every position of a 512-token window up to a 64k
# vocabulary, fewer, evenly spaced, beyond; each group's gain runs the head once a window, and on a
# 262k vocabulary every position's logits took the measurement out of memory (docs/decisions/0044).
HEAD_LOGITS = 1 << 25
BANDS = 10  # layer_groups: bands of adjacent blocks


def program_bytes(module: nn.Module, recipe_of: Callable[[str], str], embedding: str | None, group_size: int) -> int:
    """The weights' bytes of a program of `module` (a Decoder) whose linears take recipe_of(name)
    and whose token embedding is `embedding` (4w, 8w, None: fp32; an int4 table's scales are fp32:
    it runs outside the delegate), with the float rest (norms, RoPE tables, a head rotation). A tied
    head shares the embedding's integers when their widths match (compile)."""
    tied = getattr(getattr(module, "config", None), "tie_embeddings", False)
    total, counted = 0, set()
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            recipe = recipe_of(name)
            out_features, in_features = m.weight.shape
            size = linear_bytes(out_features, in_features, recipe, group_size)
            if name == "output" and tied and (recipe, embedding) in (("8da4w", "4w"), ("8da8w", "8w"), ("fp32", None)):
                size = m.weight.numel() // group_size * 2 if recipe == "8da4w" else 0  # int4: its own bf16 scales
            total += size + (m.bias.numel() * 4 if m.bias is not None else 0)
        elif isinstance(m, nn.Embedding):
            n, rows = m.weight.numel(), m.weight.shape[0]
            total += {"4w": n // 2 + n // group_size * 4, "8w": n + rows * 4, None: n * 4}[embedding]
        else:
            continue
        counted.update(id(p) for p in m.parameters(recurse=False))
    total += sum(p.numel() * p.element_size() for p in module.parameters() if id(p) not in counted)
    total += sum(
        b.numel() * b.element_size() for name, b in module.named_buffers() if "_cache" not in name
    )  # not the KV cache
    return total


def graph_bytes(n_layers: int, n_methods: int) -> int:
    """A bound on what a program of n_layers blocks and n_methods methods holds beside its weights."""
    return GRAPH_BYTES + GRAPH_BYTES_PER_BLOCK_AND_METHOD * n_layers * n_methods


def layer_groups(names: list[str], n_layers: int) -> dict[str, tuple[str, ...]]:
    """The candidates grouped by kind (wq, ..., w2) and by band of about n_layers / BANDS adjacent
    blocks, the unit a budget promotes: a gain measured for one linear alone is mostly noise."""
    width = max(1, round(n_layers / BANDS))
    groups = {}
    for name in names:
        block = int(name.split(".")[1])
        first = block // width * width
        groups.setdefault(f"{name.rpartition('.')[2]}@{first}-{min(first + width, n_layers) - 1}", []).append(name)
    return {g: tuple(members) for g, members in groups.items()}


def table_chunks(vocab: int) -> tuple[tuple[int, int], ...]:
    """A tied table's candidate rows, [start, end) each: the first 1024, then chunks doubling in size
    ([1024, 2048), [2048, 4096), ...) up to half the vocabulary. The lowest ids are the most
    frequent tokens (recipes.table_8bit_rows), so a chunk is worth less per row than the one before."""
    chunks, start, end = [], 0, 1024
    while end <= vocab // 2:
        chunks.append((start, end))
        start, end = end, 2 * end
    return tuple(chunks)


def table_group(start: int, end: int) -> str:
    return f"table@{start}-{end - 1}"


def table_row_bytes(dim: int, group_size: int) -> int:
    """What a row of a tied 4-bit table adds at 8 bits (program_bytes): int8 values and one fp32
    scale, read by lookup and head alike, against int4 values, the head's bf16 group scales and the
    lookup's fp32 ones."""
    return dim + 4 - (dim // 2 + dim // group_size * 6)


def scored_positions(length: int, vocab: int, head_logits: int = HEAD_LOGITS) -> torch.Tensor:
    """The positions of a window of `length` tokens whose next-token distributions a size budget
    compares: all of them while length x vocab <= head_logits, else as many as fit, evenly spaced,
    the last one included."""
    count = max(1, min(length, head_logits // vocab))
    return torch.linspace(length - 1, 0, count).round().long().unique()  # from the last down: one is the last


@torch.no_grad()
def promotion_gains(
    module: nn.Module,
    four_bit: dict[str, torch.Tensor],
    eight_bit: dict[str, torch.Tensor],
    groups: dict[str, tuple[str, ...]],
    windows: list[list[int]],
    head_logits: int = HEAD_LOGITS,
    table: torch.Tensor | None = None,
) -> dict[str, float]:
    """For each group of `groups` (of the layers of `four_bit`, {linear name: its 4-bit weight as
    float}): KL(float || every layer at 4 bits) minus the same with that group's layers at 8 bits
    (`eight_bit`, the same as float), in nats per token over `windows` (token lists, each from
    position 0), at each window's scored_positions. A group's change is measured by running the
    blocks from its first on, from the hidden states the 4-bit model gives that block.
    `table`: a tied table's 4-bit values as float, read by lookup and head alike in the 4-bit model
    (changed in place and restored); each of its table_chunks is a candidate too, its rows at 8 bits
    (torchao's 8da8w rule on the float rows), measured by running the whole model where the window
    looks up one of its rows, else the head alone. The module (weights, KV cache) is left as it was."""
    from genai_pipeline.upstream.executorch_logs import native_logs_hidden

    state = {k: v.clone() for k, v in module.named_buffers()}
    linears = {n: module.get_submodule(n) for n in four_bit}
    originals = {n: m.weight.data for n, m in linears.items()}
    tied = (module.get_submodule(LOOKUP), module.get_submodule(HEAD)) if table is not None else ()
    tied_originals = [m.weight.data for m in tied]
    chunks = table_chunks(table.shape[0]) if table is not None else ()
    if table is not None:  # one tensor for lookup and head
        table = table.to(tied_originals[0].dtype)

    def eight_bit_rows(start: int, end: int) -> torch.Tensor:
        q, d = torchao_qparams(tied_originals[0][start:end], module.config.dim, bits=8, bf16=False)
        return (q.float() * d).to(table.dtype)

    def take(weights: dict[str, torch.Tensor]) -> None:
        for n, w in weights.items():
            linears[n].weight.data = w.to(originals[n].dtype)

    def take_table(weights) -> None:
        for m, w in zip(tied, weights):
            m.weight.data = w

    gains, tokens = dict.fromkeys([*groups, *(table_group(*c) for c in chunks)], 0.0), 0
    try:
        for window in iterate_with_progress(windows, f"measuring {len(gains)} candidates' gain from 8 bits"):
            x, pos = torch.tensor([window]), torch.tensor([0])
            scored = scored_positions(len(window), module.config.vocab_size, head_logits)

            def log_probs(hidden: torch.Tensor) -> torch.Tensor:
                return torch.log_softmax(module.head(hidden[:, scored])[0].float(), -1)

            with native_logs_hidden():  # ExecuTorch's custom ops log from C++ in eager mode too
                take(originals)
                take_table(tied_originals)
                reference = log_probs(module.forward_blocks(module.embed(x), pos))
                take(four_bit)
                if table is not None:
                    take_table((table, table))

                def kl(hidden: torch.Tensor) -> float:
                    return float((reference.exp() * (reference - log_probs(hidden))).sum())

                inputs = []  # each block's input in the all-4-bit model
                hooks = [b.register_forward_pre_hook(lambda _, args: inputs.append(args[0])) for b in module.layers]
                try:
                    last = module.forward_blocks(module.embed(x), pos)
                    base = kl(last)
                finally:
                    for hook in hooks:
                        hook.remove()
                for g, members in groups.items():
                    take({n: eight_bit[n] for n in members})
                    first = min(int(n.split(".")[1]) for n in members)
                    gains[g] += base - kl(module.forward_blocks(inputs[first], pos, first=first))
                    take({n: four_bit[n] for n in members})
                for start, end in chunks:
                    four = table[start:end].clone()
                    table[start:end] = eight_bit_rows(start, end)
                    looked_up = bool(((x >= start) & (x < end)).any())
                    gains[table_group(start, end)] += base - kl(
                        module.forward_blocks(module.embed(x), pos) if looked_up else last
                    )
                    table[start:end] = four
            tokens += len(scored)
        return {g: v / tokens for g, v in gains.items()}
    finally:
        take(originals)
        take_table(tied_originals)
        for k, v in module.named_buffers():
            v.copy_(state[k])


def promote(
    module: nn.Module,
    four_bit: dict[str, torch.Tensor],
    eight_bit: dict[str, torch.Tensor],
    windows: list[list[int]],
    room: float,
    group_size: int,
    table: torch.Tensor | None = None,
) -> tuple[tuple[str, ...], int]:
    """The layers of `four_bit` (see promotion_gains) to store at 8 bits within `room` more bytes,
    and how many of a tied `table`'s first rows: by layer_groups and table_chunks, greedily by
    measured gain per extra byte, a chunk only after those before it; groups that gain nothing stay
    at 4 bits."""
    started = time.perf_counter()
    groups = layer_groups(list(four_bit), len(module.layers))
    gains = promotion_gains(module, four_bit, eight_bit, groups, windows, table=table)

    def extra(n: str) -> int:
        out_features, in_features = module.get_submodule(n).weight.shape
        return linear_bytes(out_features, in_features, "8da8w", group_size) - linear_bytes(
            out_features, in_features, "8da4w", group_size
        )

    cost = {g: sum(map(extra, members)) for g, members in groups.items()}
    chunks = table_chunks(table.shape[0]) if table is not None else ()
    row = table_row_bytes(module.config.dim, group_size)
    cost.update({table_group(start, end): (end - start) * row for start, end in chunks})
    previous = {table_group(*c): table_group(*p) for p, c in zip(chunks, chunks[1:])}
    order = sorted(gains, key=lambda g: gains[g] / cost[g], reverse=True)
    chosen, left = [], room

    def can_take(g: str) -> bool:
        in_order = g not in previous or previous[g] in chosen  # a table chunk after the rows before it
        return in_order and g not in chosen and gains[g] > 0 and cost[g] <= left

    # the best that fits, asked again after each choice: a chunk may have waited for the one before it
    while (g := next((g for g in order if can_take(g)), None)) is not None:
        chosen.append(g)
        left -= cost[g]
    rows = max((end for start, end in chunks if table_group(start, end) in chosen), default=0)
    log.info(
        "size budget: %d of %d candidates at 8 bits (%s; %.1f of %.1f MB to spare), measured on %d tokens "
        "(the KL at %d of their positions) in %.0f s",
        len(chosen),
        len(gains),
        " ".join(sorted(chosen)),
        (room - left) / 1e6,
        room / 1e6,
        sum(map(len, windows)),
        sum(len(scored_positions(len(w), module.config.vocab_size)) for w in windows),
        time.perf_counter() - started,
    )
    promoted = {n for g in chosen if g in groups for n in groups[g]}
    return tuple(n for n in four_bit if n in promoted), rows


def budget_room(decoder: nn.Module, options: QuantOptions, n_methods: int) -> float:
    """The bytes a size budget leaves for 8-bit layers beyond a program of n_methods methods with
    every candidate at 4 bits (program_bytes, graph_bytes); a budget below it is refused."""
    n_layers = len(decoder.layers)
    smallest = linear_recipes(decoder, dataclasses.replace(options, promoted=()))
    floor = program_bytes(decoder, smallest.get, options.embedding, options.group_size) + graph_bytes(
        n_layers, n_methods
    )
    if floor > options.size_budget * 1e6:
        raise InputError(
            f"--size-budget {options.size_budget:g} MB is too small: with every layer at 4 bits this program takes "
            f"{floor / 1e6:.2f} MB; raise the budget"
        )
    return options.size_budget * 1e6 - floor


def with_promoted(
    prepared: PreparedModel, decoder: nn.Module, options: QuantOptions, int4: Mapping, room: float
) -> QuantOptions:
    """`options` with the linears its size budget keeps at 8 bits within `room` more bytes
    (budget_room; size_budget.py), measured on held_out_tokens with each candidate at the 4-bit
    values the export stores (`int4`: gptq's or a GGUF's, else the weight rule's) or at 8da8w's."""

    def dequantized(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:  # in place: one float copy of a large table
        w = q.float()
        w.view(q.shape[0], d.shape[1], -1).mul_(d.float().unsqueeze(-1))
        return w

    smallest = linear_recipes(decoder, dataclasses.replace(options, promoted=()))
    four_bit, eight_bit, rule = {}, {}, RULES[options.weight_rule]

    def four(m: nn.Linear, name: str) -> torch.Tensor:
        return dequantized(*(int4.get(f"{name}.weight") or rule(m.weight, options.group_size)))

    for name, m in decoder.named_modules():
        if isinstance(m, nn.Linear) and name.startswith("layers.") and smallest[name] == "8da4w":
            four_bit[name] = four(m, name)
            eight_bit[name] = dequantized(
                *torchao_qparams(m.weight, m.in_features, bits=8, bf16=False)
            )  # torchao's 8da8w rule
    table = four(decoder.output, HEAD) if table_splits(options, decoder, smallest.get(HEAD)) else None
    tokens, window = held_out_tokens(prepared, options), min(SENSITIVITY_WINDOW, prepared.options.max_seq_len)
    windows = [tokens[i : i + window] for i in range(0, len(tokens), window)]
    promoted, rows = promote(decoder, four_bit, eight_bit, windows, room, options.group_size, table)
    return dataclasses.replace(options, promoted=promoted, table_8bit_rows=rows)
