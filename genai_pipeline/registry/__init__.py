"""Model registry: each entry is data (config, checkpoint key map, tokenizer, special tokens).

Model knowledge lives in the entries, one module per family; nothing else branches on names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from genai_pipeline.errors import UnknownModelError
from genai_pipeline.models.decoder import DecoderConfig


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    description: str
    config: DecoderConfig
    # (regex over checkpoint tensor names, replacement naming our tensor), first match wins.
    key_map: tuple[tuple[str, str], ...]
    # Reads a checkpoint's config.json into a DecoderConfig of this family.
    config_from_hf: Callable[[dict], DecoderConfig]
    hf_model_types: tuple[str, ...]  # `model_type` values in config.json this entry reads
    bos_id: int | None
    eos_ids: tuple[int, ...]
    checkpoint: Path | None = None  # shipped weights, if any
    # Weight transform for fused checkpoint tensors: (regex, replacements naming our tensors).
    # The checkpoint tensor is ours concatenated along dim 0 in this order, e.g. Phi-3's
    # qkv_proj = [wq; wk; wv]; the loader splits it by the sizes of our tensors.
    fused_key_map: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def map_key(self, checkpoint_key: str) -> tuple[str, ...]:
        """Our tensor(s) holding a checkpoint tensor: one, several for a fused one, none if unknown."""
        for pattern, replacement in self.key_map:
            if re.fullmatch(pattern, checkpoint_key):
                return (re.sub(pattern, replacement, checkpoint_key),)
        for pattern, replacements in self.fused_key_map:
            if re.fullmatch(pattern, checkpoint_key):
                return tuple(re.sub(pattern, r, checkpoint_key) for r in replacements)
        return ()


def _all_specs() -> dict[str, ModelSpec]:
    from genai_pipeline.registry import gemma, llama, phi, qwen, smollm

    specs = [spec for family in (llama, qwen, smollm, phi, gemma) for spec in family.SPECS]
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
        raise UnknownModelError(f"no registry entry reads model_type '{model_type}'; supported: {', '.join(types)}")

    def same_size(s: ModelSpec) -> bool:
        try:
            c = s.config_from_hf(hf_config)
        except (KeyError, TypeError, ValueError):
            return False
        return (c.dim, c.n_layers, c.vocab_size) == (s.config.dim, s.config.n_layers, s.config.vocab_size)

    return next((s for s in candidates if same_size(s)), candidates[0])
