"""Backends. Each is one small module that builds a `Target`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from genai_pipeline.errors import InputError


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    recipes: tuple[str, ...]  # quantization recipes this backend accepts
    partitioners: Callable[[], list]  # ExecuTorch partitioners; empty: no delegate
    embedding_recipes: tuple[str, ...] = ()
    # (QuantOptions, the exported quantize graph's module) -> a PT2E quantizer, for static recipes
    static_quantizer: Callable | None = None
    # Why programs cannot be lowered on this host (a missing vendor SDK), or None when they can.
    lowering_blocked: Callable[[], str | None] = lambda: None
    # Rewrites an eager graph module in place into the form this backend lowers best, right
    # before it is exported for lowering (calibrated QDQ graphs pass through unchanged).
    adapt_for_lowering: Callable[[object], None] = lambda module: None


def get_target(name: str) -> Target:
    from genai_pipeline.targets import portable, qnn, xnnpack

    targets = {t.name: t for t in (xnnpack.TARGET, portable.TARGET, qnn.TARGET)}
    if name not in targets:
        raise InputError(f"unknown target '{name}'; known targets: {', '.join(targets)}")
    return targets[name]


def check_recipe(target: Target, quant) -> None:
    """Refuse a quantization (a quantize.QuantOptions) the backend cannot run."""
    for recipe in (quant.recipe, *(r for _, r in quant.overrides)):
        if recipe not in target.recipes:
            raise InputError(f"target '{target.name}' does not support recipe '{recipe}'; it supports: {', '.join(target.recipes)}")
    if quant.embedding and quant.embedding not in target.embedding_recipes:
        supported = ", ".join(target.embedding_recipes) or "none"
        raise InputError(f"target '{target.name}' does not support --embedding {quant.embedding}; it supports: {supported}")
