"""A registry entry's type: what the pipeline knows of a model (a leaf: the family modules build
entries of it, the registry's __init__ collects them)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.tokenizer import TokenizerKind

# How a checkpoint folder stores its weights: Hugging Face (config.json + *.safetensors) or
# llama2.c (one torch.save'd *.pt holding `model` and `model_args`).
CHECKPOINT_FORMATS = ("hf", "llama2c")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    description: str
    config: DecoderConfig
    # (regex over checkpoint tensor names, replacement naming our tensor), first match wins.
    key_map: tuple[tuple[str, str], ...]
    # Reads a checkpoint's own description of its shapes into a DecoderConfig of this family:
    # config.json as a dict, or for checkpoint_format "llama2c" the .pt's `model_args`.
    config_from_checkpoint: Callable[[dict], DecoderConfig]
    hf_model_types: tuple[str, ...]  # `model_type` values in config.json this entry reads
    bos_id: int | None
    eos_ids: tuple[int, ...]
    checkpoint: Path | None = None  # shipped weights, if any
    # Weight transform for fused checkpoint tensors: (regex, replacements naming our tensors).
    # The checkpoint tensor is ours concatenated along dim 0 in this order, e.g. Phi-3's
    # qkv_proj = [wq; wk; wv]; the loader splits it by the sizes of our tensors.
    fused_key_map: tuple[tuple[str, tuple[str, ...]], ...] = ()
    checkpoint_format: str = "hf"  # one of CHECKPOINT_FORMATS: which loader reads --checkpoint
    tokenizer_kind: TokenizerKind = TokenizerKind.HF_JSON  # the tokenizer file its checkpoints carry
    # Jinja chat template for checkpoints that carry none (the export writes it as chat_template.jinja).
    chat_template: str | None = None
    # The registry entry this spec is or derives from (a checkpoint of another size: see `sized_as`).
    entry: str = ""
    # A vision-language model's image side (registry.multimodal.VisionSpec); None: text only. Its
    # key_map then names tensors of `models.vision.VisionLanguageModel` (decoder.*, vision.*).
    vision: object | None = None
    # A speech-language model's audio side (registry.multimodal.AudioSpec); None: no audio. Its
    # key_map then names tensors of `models.audio.AudioLanguageModel` (decoder.*, audio.*).
    audio: object | None = None

    def __post_init__(self):
        if not self.entry:
            object.__setattr__(self, "entry", self.name)
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"{self.name}: checkpoint_format must be one of {', '.join(CHECKPOINT_FORMATS)}, got '{self.checkpoint_format}'"
            )

    def map_key(self, checkpoint_key: str) -> tuple[str, ...]:
        """Our tensor(s) holding a checkpoint tensor: one, several for a fused one, none if unknown."""
        for pattern, replacement in self.key_map:
            if re.fullmatch(pattern, checkpoint_key):
                return (re.sub(pattern, replacement, checkpoint_key),)
        for pattern, replacements in self.fused_key_map:
            if re.fullmatch(pattern, checkpoint_key):
                return tuple(re.sub(pattern, r, checkpoint_key) for r in replacements)
        return ()
