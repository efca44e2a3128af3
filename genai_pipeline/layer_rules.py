"""Which linear layer takes which recipe: a recipe is an ordered tuple of Rule, and a layer takes
the recipe of the first rule it matches (the shape of ExecuTorch's QuantRecipe). Torch-free: the
options carry rules (QuantOptions.rules) and an export's manifest records those it applied;
quantize/recipes.py builds each recipe's."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from genai_pipeline.errors import InputError

BLOCK = re.compile(r"layers\.(\d+)\.")  # a linear's block, in its name (`layers.3.attention.wv`)


@dataclass(frozen=True)
class Rule:
    """The linears in whose name the regex `pattern` is found take `recipe` (fp32, 8da4w, 8da8w),
    in the blocks `layers` only (None: anywhere)."""

    pattern: str
    recipe: str
    layers: tuple[int, ...] | None = None

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise InputError(f"rule pattern '{self.pattern}' is not a valid regex: {e}") from None
        if self.layers is not None:  # e.g. a list from JSON
            object.__setattr__(self, "layers", tuple(sorted({int(i) for i in self.layers})))

    def matches(self, name: str) -> bool:
        if self.layers is not None:
            block = BLOCK.search(name)
            if block is None or int(block[1]) not in self.layers:
                return False
        return re.search(self.pattern, name) is not None


def read_rules(rules: Iterable | None) -> tuple[Rule, ...] | None:
    """Rules given as Rule or in their manifest form (dicts); None stays None."""
    return None if rules is None else tuple(r if isinstance(r, Rule) else Rule(**r) for r in rules)


def recipe_of(name: str, rules: Iterable[Rule], default: str | None = "fp32") -> str | None:
    """The recipe of the first rule that linear `name` matches; `default` if none does (fp32: left float)."""
    return next((r.recipe for r in rules if r.matches(name)), default)


def rules_naming(names: Iterable[str], recipe: str) -> tuple[Rule, ...]:
    """Rules giving exactly the linears `names` `recipe`: one per kind of block linear
    (`feed_forward.w2`) over the blocks named, one per other linear."""
    blocks: dict[str, set[int]] = {}
    others = []
    for name in names:
        block = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if block:
            blocks.setdefault(block[2], set()).add(int(block[1]))
        else:
            others.append(Rule(f"^{re.escape(name)}$", recipe))
    kinds = (Rule(rf"^layers\.\d+\.{re.escape(kind)}$", recipe, tuple(b)) for kind, b in blocks.items())
    return (*others, *kinds)
