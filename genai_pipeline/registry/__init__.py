"""Model registry: each entry is data (config, checkpoint key map, tokenizer, special tokens).

Model knowledge lives in the entries, one module per family; nothing else branches on names.
"""

from __future__ import annotations

import dataclasses
import difflib

from genai_pipeline.errors import UnknownModelError
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.registry.spec import CHECKPOINT_FORMATS, ModelSpec  # noqa: F401 (the registry's types)


def _all_specs() -> dict[str, ModelSpec]:
    from genai_pipeline.registry import (
        gemma,
        gemma3_vision,
        granite,
        internvl,
        lfm2,
        llama,
        llama2c,
        llava,
        mistral,
        olmo,
        phi,
        qwen,
        smollm,
        smolvlm,
        voxtral,
    )

    text = (llama, qwen, smollm, granite, olmo, mistral, lfm2, phi, gemma, llama2c)
    families = (*text, smolvlm, llava, internvl, gemma3_vision, voxtral)
    specs = [spec for family in families for spec in family.SPECS]
    names = [spec.name for spec in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise RuntimeError(f"registry names must be unique; repeated: {', '.join(duplicates)}")
    return {spec.name: spec for spec in specs}


SPECS: dict[str, ModelSpec] = _all_specs()
DEFAULT_MODEL = "reference"


def get_spec(name: str) -> ModelSpec:
    try:
        return SPECS[name]
    except KeyError:
        raise UnknownModelError(f"unknown model '{name}'; known models: {', '.join(sorted(SPECS))}") from None


def infer_spec(hf_config: dict) -> ModelSpec:
    """The entry for a checkpoint's config.json: its `model_type`, and among those the entry
    whose embedded config has the same sizes (any of them reads the checkpoint's own config)."""
    model_type = hf_config.get("model_type")
    candidates = [s for s in SPECS.values() if model_type in s.hf_model_types]
    if not candidates:
        types = sorted({t for s in SPECS.values() for t in s.hf_model_types})
        close = difflib.get_close_matches(str(model_type), types, n=3, cutoff=0.5)
        closest = f"; closest: {', '.join(close)}" if close else ""
        raise UnknownModelError(
            f"no registry entry reads model_type '{model_type}'{closest}; supported: {', '.join(types)}"
        )
    return _by_size(candidates, hf_config)


def infer_llama2c_spec(model_args: dict) -> ModelSpec:
    """The llama2.c entry whose embedded config has the sizes of a checkpoint's `model_args`, else
    a custom spec of the llama2.c family."""
    return _by_size([s for s in SPECS.values() if s.checkpoint_format == "llama2c"], model_args)


def _by_size(candidates: list[ModelSpec], checkpoint_config: dict) -> ModelSpec:
    """The candidate whose embedded config has the checkpoint's sizes; else the family, named as custom."""
    config = None
    for spec in candidates:
        try:
            config = spec.config_from_checkpoint(checkpoint_config)
        except (KeyError, TypeError, ValueError):
            continue
        if _sizes(config) == _sizes(spec.config):
            return spec
    return candidates[0] if config is None else sized_as(candidates[0], config)


def _sizes(config: DecoderConfig) -> tuple[int, int, int]:
    return config.dim, config.n_layers, config.vocab_size


def sized_as(spec: ModelSpec, config: DecoderConfig) -> ModelSpec:
    """`spec` for a checkpoint with `config`: itself when the sizes match, else its family with the
    checkpoint's config under a name that says so, never another entry's name."""
    if _sizes(config) == _sizes(spec.config):
        return spec
    name = f"{spec.family} (custom: {config.n_layers} layers, dim {config.dim})"
    return dataclasses.replace(
        spec,
        name=name,
        description=f"a {spec.family} checkpoint of sizes no entry lists",
        config=config,
        checkpoint=None,
        entry=spec.entry,
    )
