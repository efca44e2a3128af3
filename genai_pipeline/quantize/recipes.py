"""quantize, the recipes as rule lists: which recipe each linear layer takes (layer_rules.Rule, first
match wins; recipe_rules writes each recipe's, rules_for puts --quant-override's and a size budget's
promotions before them), and quantize_module, which applies them to a module in place."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from genai_pipeline.errors import InputError
from genai_pipeline.layer_rules import Rule, recipe_of, rules_naming
from genai_pipeline.models.table_parts import TableHead, split_table
from genai_pipeline.options import QuantOptions
from genai_pipeline.quantize.rotation import rotates_inputs
from genai_pipeline.quantize.weights import (
    RULES,
    embedding_config,
    given_qparams,
    intx_weight,
    linear_bytes,
    linear_config,
)

log = logging.getLogger(__name__)


HEAD = "output"
LOOKUP = "tok_embeddings"
# 8da4w: a tied 4-bit table's first rows at 8 bits, as many as add at most this share to the bytes
# of the linears a decode step reads (table_8bit_rows; docs/decisions/0038)
TABLE_8BIT_SHARE = 0.04
# ... and where the linears' inputs are rotated at run time (rotation.rotates_inputs), this share: those
# rotations take most of the decode time the rows had (docs/decisions/0040)
TABLE_8BIT_SHARE_ROTATED_INPUTS = 0.016
EDGE_SHARE = 1 / 15  # 8da4w's edge layers: the first and last 1/15 of the blocks
# 8da4w: where a tied table holds at least this share of a decoder's weights, its head takes most of a
# decode step and the blocks' 4-bit loss is beyond what the table's 8-bit rows recover: every block
# linear takes 8 bits (for_decoder; docs/decisions/0047)
TABLE_DOMINATES = 0.5
BLOCKS = r"^layers\."  # every block linear (for_decoder's rule)


def more_bits_layers(n_layers: int) -> tuple[int, ...]:
    """llama.cpp's `use_more_bits` (the layers whose ffn_down and attn_v Q4_K_M stores at 6 bits):
    the first and last eighth of the blocks, and every third block between them."""
    eighth = n_layers // 8
    return tuple(i for i in range(n_layers) if i < eighth or i >= 7 * n_layers // 8 or (i - eighth) % 3 == 2)


def edge_layers(n_layers: int) -> tuple[int, ...]:
    """The first and last EDGE_SHARE of n_layers blocks (SmolLM2-135M: 0, 1, 28, 29; none below 15)."""
    k = int(n_layers * EDGE_SHARE)
    return tuple(i for i in range(n_layers) if i < k or i >= n_layers - k)


def head_recipe(options: QuantOptions) -> str | None:
    """The LM head's recipe when it is not the recipe's: `head`, or by default 8da8w under 8da4w
    when its 4-bit weights are not calibrated: at 4 bits by mse it costs much, by GPTQ less than
    what its bytes buy elsewhere (docs/decisions/0011)."""
    if options.head != "auto":
        return options.head
    return "8da8w" if options.recipe == "8da4w" and options.weight_rule != "gptq" else None


def table_splits(options: QuantOptions, decoder: nn.Module, head: str | None) -> bool:
    """Whether `decoder`'s table can keep its first rows at 8 bits under `options`: a tied table at 4
    bits (8da4w, --embedding 4w, `head` the head's recipe by the rules: 8da4w)."""
    return options.recipe == "8da4w" and decoder.config.tie_embeddings and options.embedding == "4w" and head == "8da4w"


def table_8bit_rows(options: QuantOptions, decoder: nn.Module, head: str | None) -> int:
    """How many of `decoder`'s first table rows 8da4w stores at 8 bits, for lookup and LM head alike
    (`head`: the head's recipe by the rules): options.table_8bit_rows, or by default the most, in
    multiples of 1024, whose extra bytes are at most TABLE_8BIT_SHARE (TABLE_8BIT_SHARE_ROTATED_INPUTS
    where the linears' inputs are rotated) of the bytes of the decoder's linears at their recipes: a
    decode step reads those, so its time grows by about that much.
    Vocabularies number tokens about in the order their merges were learnt, so the first rows are
    the most frequent tokens: no data picks them. Only a tied table at 4 bits has them (table_splits);
    under a size budget, the number its measurement chose (size_budget.py). Anything else, or a
    number given beside a budget, is refused."""
    vocab, dim = decoder.config.vocab_size, decoder.config.dim
    # a size budget chooses them (size_budget.py): none before its choice, its number after
    applies = table_splits(options, decoder, head) and (options.size_budget is None or options.promoted is not None)
    if options.table_8bit_rows is None:
        if not applies or options.size_budget is not None:
            return 0
        recipes = linear_recipes(decoder, options)
        read = sum(
            linear_bytes(*decoder.get_submodule(n).weight.shape, r, options.group_size) for n, r in recipes.items()
        )
        extra = linear_bytes(1, dim, "8da8w", options.group_size) - linear_bytes(1, dim, "8da4w", options.group_size)
        share = TABLE_8BIT_SHARE_ROTATED_INPUTS if options.rotate and rotates_inputs(decoder) else TABLE_8BIT_SHARE
        rows = int(share * read / extra) // 1024 * 1024
        return rows if rows < vocab else 0
    if options.table_8bit_rows and not applies:
        raise InputError(
            "--table-8bit-rows applies to a tied token table at 4 bits (--recipe 8da4w, --embedding 4w, an 8da4w LM "
            "head), and a --size-budget chooses the rows itself; drop it, or use --embedding 8w for a whole table at 8 bits"
        )
    if options.table_8bit_rows >= vocab:
        raise InputError(
            f"--table-8bit-rows {options.table_8bit_rows} is the whole table of {vocab} rows: give fewer, or use "
            "--embedding 8w --quant-override output=8da8w"
        )
    return options.table_8bit_rows


def table_share(decoder: nn.Module) -> float:
    """The share of `decoder`'s weights (its table and block linears) its tied table holds; 0 untied."""
    config = decoder.config
    if not config.tie_embeddings:
        return 0.0
    table = config.vocab_size * config.dim
    return table / (table + sum(m.weight.numel() for m in decoder.layers.modules() if isinstance(m, nn.Linear)))


def for_decoder(options: QuantOptions, decoder: nn.Module) -> QuantOptions:
    """`options` as they apply to `decoder`: under 8da4w, where its tied table holds at least
    TABLE_DOMINATES of its weights, every block linear at 8 bits (`keep_8bit`) and no run-time
    rotation of their inputs (rotation.rotates_inputs): those would feed 8-bit linears only, for a
    few percent of a step. Options that name the 8-bit layers (`keep_8bit`, a size budget, an
    export's own `rules`) are kept as they are."""
    named = options.keep_8bit is not None or options.size_budget is not None or options.rules is not None
    share = table_share(decoder)
    if options.recipe != "8da4w" or named or share < TABLE_DOMINATES:
        return options
    log.info("the tied table holds %.0f %% of the weights: every block linear at 8 bits", 100 * share)
    return dataclasses.replace(options, keep_8bit=(BLOCKS,), rotate=options.rotate and not rotates_inputs(decoder))


def eight_bit_patterns(options: QuantOptions) -> tuple[str, ...]:
    """The layers 8da4w keeps at 8 bits in every block: `keep_8bit`, or by default the attention's
    value projection, as llama.cpp's Q4_K_M keeps attn_v higher (docs/decisions/0011); none under a
    size budget, which measures instead (size_budget.py)."""
    if options.keep_8bit is not None:
        return options.keep_8bit
    return () if options.size_budget is not None else (r"\.attention\.wv$",)


def recipe_rules(options: QuantOptions, n_layers: int, given: Iterable[str] = ()) -> tuple[Rule, ...]:
    """What `options.recipe` gives each linear of a decoder of n_layers blocks, first match wins.
    Under 8da4w the linears whose int4 weights are `given` (a GGUF's) keep them, before the 8-bit
    rules. A static recipe has none: the target's quantizer annotates every layer (targets/)."""
    if options.is_static:
        return ()
    rules = [Rule(r"^head_rotation$", "fp32")]  # rotation's float d x d before a tied head (rotation.py)
    if options.recipe == "8da4w":
        rules += [Rule(p, "8da8w") for p in eight_bit_patterns(options)]
        # a size budget measures instead (size_budget.py); every block at 8 bits needs no more
        if options.size_budget is None and BLOCKS not in eight_bit_patterns(options):
            rules += [
                # the MLP's down projection where Q4_K_M gives ffn_down more bits; every w2 at 8 bits
                # cost 1-thread decode speed beyond the bound (docs/decisions/0020)
                Rule(r"^layers\.\d+\.feed_forward\.w2$", "8da8w", more_bits_layers(n_layers)),
                # w1 / w3 of the blocks whose outputs lose the most to 4 bits (layer SQNR; docs/decisions/0016)
                Rule(r"^layers\.\d+\.feed_forward\.w[13]$", "8da8w", edge_layers(n_layers)),
            ]
    head = head_recipe(options)
    if head:
        rules.append(Rule(f"^{HEAD}$", head))
    rules = [r for r in rules if r.layers != ()]  # a band of no blocks (a shallow model's edges)
    if options.recipe == "8da4w":  # given int4 weights outrank the 8-bit rules: those layers keep them
        rules[:0] = rules_naming([n for n in given if recipe_of(n, rules, "8da4w") != "8da4w"], "8da4w")
    return (*rules, Rule(".*", options.recipe))


def rules_for(options: QuantOptions, n_layers: int, given: Iterable[str] = ()) -> tuple[Rule, ...]:
    """Every rule of an export's decoder, first match wins: --quant-override's, then a size budget's
    promotions (8da8w), then the recipe's (recipe_rules; with the layers of `given` int4 weights
    that no override names); `options.rules` instead when set (an export's, read back from its
    manifest, or written by hand)."""
    if options.rules is not None:
        return options.rules
    overrides = tuple(Rule(pattern, recipe) for pattern, recipe in options.overrides)
    first = overrides + rules_naming(options.promoted or (), "8da8w")
    given = [n for n in given if recipe_of(n, first, None) is None]  # --quant-override outranks given weights
    return first + recipe_rules(options, n_layers, given)


def describe(options: QuantOptions) -> str:
    """The recipe as the manifest and the logs name it: `8da4w-g32-rot-sq0.5+emb4w+attention.wv=8da8w+...`."""
    parts = [options.recipe + (f"-g{options.group_size}" if options.recipe == "8da4w" else "")]
    if options.recipe == "8da4w" and options.weight_rule != "gptq":
        parts[0] += f"-{options.weight_rule}"
    if options.recipe == "16a4w_block":
        parts[0] += f"-b{options.block_size}"
    if options.rotate:
        parts[0] += "-rot"
    if options.smooth is not None:
        parts[0] += f"-sq{options.smooth:g}"
    if options.embedding:
        parts.append(f"emb{options.embedding}")
    if not options.is_static and head_recipe(options):
        parts.append(f"head{head_recipe(options)}")
    if options.recipe == "8da4w":
        parts += [
            f"{'blocks' if p == BLOCKS else p.replace(chr(92), '').strip('.$')}=8da8w"
            for p in eight_bit_patterns(options)
        ]
    if options.table_8bit_rows:
        parts.append(f"table{options.table_8bit_rows}rows=8w")
    if options.size_budget is not None:
        parts.append(f"budget{options.size_budget:g}MB")
    elif options.recipe == "8da4w" and BLOCKS not in eight_bit_patterns(options):
        parts += ["more_bits.w2=8da8w", "edges.w1w3=8da8w"]
    parts += [f"{p}={r}" for p, r in options.overrides]
    if options.vision_recipe:
        parts.append(f"vision{options.vision_recipe}")
    return "+".join(parts)


def linear_recipes(module: nn.Module, options: QuantOptions, given: Iterable[str] = ()) -> dict[str, str]:
    """name -> recipe of every linear in `module`, by rules_for; the parts of a head split with its
    table by the head's rule (table_part_recipes)."""
    rules = rules_for(options, len(getattr(module, "layers", ())), given)
    recipes = {n: recipe_of(n, rules) for n, m in module.named_modules() if isinstance(m, nn.Linear)}
    if isinstance(getattr(module, HEAD, None), TableHead):
        recipes.update(table_part_recipes(recipe_of(HEAD, rules)))
    return recipes


def table_part_recipes(head: str) -> dict[str, str]:
    """The recipes of a head in parts (models/table_parts.py) whose whole takes `head`: its first
    rows at 8 bits, the rest at `head`. Rules name the whole head (`output`), never its parts."""
    return {f"{HEAD}.first": "8da8w", f"{HEAD}.rest": head}


def split_tied_table(decoder: nn.Module, rows: int, *values: dict) -> None:
    """`decoder`'s tied table and head in two parts, its first `rows` rows and the rest
    (models/table_parts.py), in place; the head's int4 values in each of `values` ({weight name:
    (values, scales)}) renamed and cut to the rest's rows. GPTQ's rows are independent given the
    Hessian, so the whole head's values cut are what GPTQ on the rest alone would give."""
    split_table(decoder, rows)
    for chosen in values:
        if f"{HEAD}.weight" in chosen:
            q, d = chosen.pop(f"{HEAD}.weight")
            chosen[f"{HEAD}.rest.weight"] = (q[rows:], d[rows:])
    log.info("the table's first %d rows at 8 bits, for lookup and head", rows)


def quantize_module(
    module: nn.Module, options: QuantOptions, given: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None
) -> dict[str, str]:
    """Quantize `module` in place by its rules (rules_for); returns the recipe given to each layer.

    `given` maps a linear's weight name (`layers.0.attention.wq.weight`) to int4 values [out, in]
    in [-8, 7] and fp32 scales [out, in // 32] (a GGUF's Q4_0 blocks): with recipe 8da4w and group
    size 32 that layer takes them as they are instead of quantizing its float weight. XNNPACK
    stores group scales as bf16, so a scale keeps its value only if bf16 holds it."""
    given = dict(given or {})
    linears = linear_recipes(module, options, [k.removesuffix(".weight") for k in given])
    unknown = sorted(set(given) - {f"{n}.weight" for n in linears})
    if unknown:
        raise InputError(f"given weights for layers the model does not have: {', '.join(unknown[:3])}")
    plan = quantize_embedding(module, options, linears, given)
    check_group_size(module, linears, options.group_size)
    quantize_linears(module, linears, options, given)
    if given:
        raise InputError(
            f"given int4 weights need recipe 8da4w on their layers: {', '.join(sorted(given)[:3])} got "
            f"{', '.join(sorted({linears[k[: -len('.weight')]] for k in given}))}"
        )
    plan.update(linears)
    return plan


def quantize_embedding(
    module: nn.Module,
    options: QuantOptions,
    linears: Mapping[str, str],
    given: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, str]:
    """quantize_module's token embedding (`options.embedding`; a table in parts: its first rows at 8 bits
    where their head part is 8da8w), in place: {name: emb<recipe>}."""
    from torchao.quantization import quantize_

    if not options.embedding:
        return {}
    dim = next(m.embedding_dim for m in module.modules() if isinstance(m, nn.Embedding))
    if options.embedding == "4w" and dim % options.group_size:
        raise InputError(
            f"the embedding width {dim} is not a multiple of --group-size {options.group_size}; use --embedding 8w"
        )
    tied = getattr(getattr(module, "config", None), "tie_embeddings", False)
    plan = {}
    for name, m in list(module.named_modules()):
        if not isinstance(m, nn.Embedding):
            continue
        head = name.replace(LOOKUP, HEAD, 1)
        # a table in parts (models/table_parts.py): its first rows at 8 bits, as its head part's 8da8w
        recipe = "8w" if linears.get(head) == "8da8w" and name.endswith(f"{LOOKUP}.first") else options.embedding
        # One table for lookup and head, as the checkpoint has: the head's given int4 values (chosen
        # by gptq, or a GGUF's) where its rule takes them, which the program then stores once (compile).
        tied_head = given.get(f"{head}.weight") if tied and linears.get(head) == "8da4w" else None
        if recipe == "4w" and options.weight_rule != "torchao":
            if tied_head is not None:
                q, d = given_qparams(f"{head}.weight", *tied_head, m.weight.shape, options.group_size)
            else:
                q, d = RULES[options.weight_rule](m.weight, options.group_size)
            m.weight = nn.Parameter(intx_weight(q, d, 4, m.weight.dtype, dynamic=False), requires_grad=False)
        else:
            quantize_(
                m, embedding_config(recipe, options.group_size), filter_fn=lambda x, _: isinstance(x, nn.Embedding)
            )
        plan[name] = f"emb{recipe}"
    return plan


def quantize_linears(
    module: nn.Module,
    linears: Mapping[str, str],
    options: QuantOptions,
    given: dict[str, tuple],
    any_given: bool | None = None,
) -> None:
    """The linears `linears` ({name in `module`: recipe}) of `module` quantized in place, each by its
    recipe; the int4 values `given` for one of them are taken (and popped from `given`). Beside
    given ones (`any_given`: some layer of the model has them), int4 weights are rounded layer by
    layer by options.weight_rule, also under the torchao rule."""
    from torchao.quantization import quantize_

    any_given = bool(given) if any_given is None else any_given
    for recipe in sorted(set(linears.values()) - {"fp32"}):
        chosen = {n for n, r in linears.items() if r == recipe}
        if recipe == "8da4w" and (options.weight_rule != "torchao" or any_given):
            for name in sorted(chosen):
                linear = module.get_submodule(name)
                key = f"{name}.weight"
                if key in given:
                    q, d = given_qparams(key, *given.pop(key), linear.weight.shape, options.group_size)
                else:
                    q, d = RULES[options.weight_rule](linear.weight, options.group_size)
                linear.weight = nn.Parameter(intx_weight(q, d, 4, linear.weight.dtype), requires_grad=False)
        else:
            quantize_(
                module, linear_config(recipe, options.group_size), filter_fn=lambda m, fqn, chosen=chosen: fqn in chosen
            )


def recipe_counts(plan: Mapping[str, str]) -> dict[str, int]:
    """{recipe: how many layers of `plan` ({layer: recipe}, quantize_module's) took it}, by recipe."""
    return {r: sum(1 for v in plan.values() if v == r) for r in sorted(set(plan.values()))}


def check_group_size(module: nn.Module, linears: Mapping[str, str], group_size: int) -> None:
    """Refuse a group size that does not divide the input width of every int4 linear (`linears`:
    name -> recipe). quantize() asks before calibrating, which would otherwise fail on it first."""
    widths = {module.get_submodule(n).in_features for n, recipe in linears.items() if "4w" in recipe}
    bad = sorted(w for w in widths if w % group_size)
    if bad:
        fits = [g for g in (16, 32, 64, 128, 256) if all(w % g == 0 for w in widths)]
        raise InputError(
            f"--group-size {group_size} does not divide the input width of the model's int4 layers "
            f"({', '.join(map(str, bad))}); use --group-size {' or '.join(map(str, fits)) or '8'}"
        )
