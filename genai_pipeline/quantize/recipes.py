"""quantize, which recipe each layer takes (recipe_for: the automatic 8-bit layers, overrides) and
quantize_module, which applies them to a module in place."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import torch
from torch import nn

from genai_pipeline.errors import InputError
from genai_pipeline.options import EDGE_LAYERS, QuantOptions
from genai_pipeline.quantize.weights import RULES, embedding_config, given_qparams, intx_weight, linear_config

log = logging.getLogger(__name__)


HEAD = "output"


HEAD_ROTATION = "head_rotation"


def more_bits_layer(i: int, n_layers: int) -> bool:
    """llama.cpp's `use_more_bits` (the layers whose ffn_down and attn_v Q4_K_M stores at 6 bits):
    the first and last eighth of the blocks, and every third block between them."""
    return i < n_layers // 8 or i >= 7 * n_layers // 8 or (i - n_layers // 8) % 3 == 2


def auto_8bit_mlp(name: str, recipe: str, n_layers: int) -> bool:
    """Whether `name`, an MLP projection of block i of n_layers, stays at 8 bits under `recipe`: w2
    where more_bits_layer(i), w1 and w3 in the first and last EDGE_LAYERS[recipe] of the blocks."""
    match = re.fullmatch(r"layers\.(\d+)\.feed_forward\.(w[123])", name)
    if recipe not in EDGE_LAYERS or not match:
        return False
    i, k = int(match[1]), int(n_layers * EDGE_LAYERS[recipe])
    return more_bits_layer(i, n_layers) if match[2] == "w2" else i < k or i >= n_layers - k


def recipe_for(name: str, options: QuantOptions, n_layers: int) -> str:
    """The recipe of linear layer `name` in a model of n_layers blocks (first matching override wins)."""
    default = options.head if name == HEAD and options.head else options.recipe
    if name == HEAD_ROTATION:  # rotation's float linear before a tied head (rotation.py)
        default = "fp32"
    if options.recipe == "8da4w" and (
        any(re.search(p, name) for p in options.keep_8bit)
        or name in (options.promoted or ())
        or options.size_budget is None
        and auto_8bit_mlp(name, options.recipe, n_layers)
    ):
        default = "8da8w"
    return next((r for pattern, r in options.overrides if re.search(pattern, name)), default)


def linear_recipes(module: nn.Module, options: QuantOptions) -> dict[str, str]:
    """name -> recipe_for(name) of every linear in `module`."""
    n_layers = len(getattr(module, "layers", ()))
    return {n: recipe_for(n, options, n_layers) for n, m in module.named_modules() if isinstance(m, nn.Linear)}


def quantize_module(
    module: nn.Module, options: QuantOptions, given: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None
) -> dict[str, str]:
    """Quantize `module` in place; returns the recipe given to each layer.

    `given` maps a linear's weight name (`layers.0.attention.wq.weight`) to int4 values [out, in]
    in [-8, 7] and fp32 scales [out, in // 32] (a GGUF's Q4_0 blocks): with recipe 8da4w and group
    size 32 that layer takes them as they are instead of quantizing its float weight. XNNPACK
    stores group scales as bf16, so a scale keeps its value only if bf16 holds it."""
    from torchao.quantization import quantize_

    given = dict(given or {})
    plan = {}
    if options.embedding:
        dim = next(m.embedding_dim for m in module.modules() if isinstance(m, nn.Embedding))
        if options.embedding == "4w" and dim % options.group_size:
            raise InputError(
                f"the embedding width {dim} is not a multiple of --group-size {options.group_size}; use --embedding 8w"
            )
        tied_head = (
            given.get("output.weight") if getattr(getattr(module, "config", None), "tie_embeddings", False) else None
        )
        if options.embedding == "4w" and options.weight_rule != "torchao":
            for m in module.modules():
                if isinstance(m, nn.Embedding):
                    # the head takes given weights unless an override names it (see below)
                    if (
                        tied_head is not None
                        and options.recipe == "8da4w"
                        and not any(re.search(p, HEAD) for p, _ in options.overrides)
                    ):
                        # One table for lookup and head, as the checkpoint has: the head's int4 values
                        # (chosen by gptq, or a GGUF's), which the program then stores once (compile).
                        q, d = given_qparams("output.weight", *tied_head, m.weight.shape, options.group_size)
                    else:
                        q, d = RULES[options.weight_rule](m.weight, options.group_size)
                    m.weight = nn.Parameter(intx_weight(q, d, 4, m.weight.dtype, dynamic=False), requires_grad=False)
        else:
            quantize_(
                module,
                embedding_config(options.embedding, options.group_size),
                filter_fn=lambda m, _: isinstance(m, nn.Embedding),
            )
        plan.update({n: f"emb{options.embedding}" for n, m in module.named_modules() if isinstance(m, nn.Embedding)})
    linears = linear_recipes(module, options)
    for (
        name
    ) in linears:  # given int4 weights outrank the automatic 8-bit layers (AUTO_HEAD, AUTO_8BIT), not --quant-override
        if (
            f"{name}.weight" in given
            and options.recipe == "8da4w"
            and not any(re.search(p, name) for p, _ in options.overrides)
        ):
            linears[name] = "8da4w"
    unknown = sorted(set(given) - {f"{n}.weight" for n in linears})
    if unknown:
        raise InputError(f"given weights for layers the model does not have: {', '.join(unknown[:3])}")
    check_group_size(module, linears, options.group_size)
    for recipe in sorted(set(linears.values()) - {"fp32"}):
        chosen = {n for n, r in linears.items() if r == recipe}
        if recipe == "8da4w" and options.weight_rule != "torchao" or recipe == "8da4w" and given:
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
    if given:
        raise InputError(
            f"given int4 weights need recipe 8da4w on their layers: {', '.join(sorted(given)[:3])} got "
            f"{', '.join(sorted({linears[k[: -len('.weight')]] for k in given}))}"
        )
    plan.update(linears)
    return plan


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
