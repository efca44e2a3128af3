"""Backends. Each is one small module that builds a `Target`."""

from __future__ import annotations

from genai_pipeline.errors import InputError
from genai_pipeline.targets.target import GroupedLowering, Target  # noqa: F401 (the backends' types)


def _targets() -> dict[str, Target]:
    from genai_pipeline.targets import portable, qnn, xnnpack

    return {t.name: t for t in (xnnpack.TARGET, portable.TARGET, qnn.TARGET)}


def get_target(name: str) -> Target:
    targets = _targets()
    if name not in targets:
        raise InputError(f"unknown target '{name}'; known targets: {', '.join(targets)}")
    return targets[name]


def check_recipe(target: Target, quant) -> None:
    """Refuse a quantization (an options.QuantOptions) the backend cannot run."""
    vision = (quant.vision_recipe,) if quant.vision_recipe else ()
    rules = (quant.rules or ()) + (quant.vision_rules or ())
    for recipe in (quant.recipe, *(r for _, r in quant.overrides), *vision, *(r.recipe for r in rules)):
        if recipe not in target.recipes:
            owners = [t.name for t in _targets().values() if t.name != target.name and recipe in t.recipes]
            hint = f" ('{recipe}' is a recipe of --target {' or '.join(owners)})" if owners else ""
            raise InputError(
                f"target '{target.name}' does not support recipe '{recipe}'{hint}; it supports: {', '.join(target.recipes)}"
            )
    if quant.embedding and quant.embedding not in target.embedding_recipes:
        supported = ", ".join(target.embedding_recipes) or "none"
        raise InputError(
            f"target '{target.name}' does not support --embedding {quant.embedding}; it supports: {supported}"
        )
