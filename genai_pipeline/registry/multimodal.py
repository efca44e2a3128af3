"""What a multimodal entry adds to a text one: its image or audio tower, how a checkpoint describes
it, and its processor's defaults (the checkpoint's own processor files win; see image_processing.py
and audio_processing.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from genai_pipeline.audio_processing import AudioProcessing
from genai_pipeline.image_processing import ImageProcessing
from genai_pipeline.models.audio import AudioConfig
from genai_pipeline.models.vision_config import VisionConfig


@dataclass(frozen=True)
class VisionSpec:
    config: VisionConfig
    # config.json (the whole composite one) -> the encoder's config; normalisation comes from the processor
    config_from_checkpoint: Callable[[dict], VisionConfig]
    preprocessing: ImageProcessing  # defaults for a checkpoint without processor files
    image_token_id: int  # the id of `<image>`, whose positions take the image's embeddings
    # The tower takes any size (Qwen2.5-VL): a program's is the processor's tile, not config.json's.
    size_from_processor: bool = False
    # checkpoint tensors (regex) stored [in, out], transposed into our nn.Linear's [out, in] on load
    transposed_keys: tuple[str, ...] = ()


def composite_text_key_map(key_map: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """A text family's key map for its decoder inside a vision-language checkpoint, in both layouts:
    transformers 4.x (`language_model.model.*`, `language_model.lm_head`) and 5.x
    (`model.language_model.*`, `lm_head`); ours under `decoder.`."""
    return tuple(
        (
            pattern.replace(r"model\.", r"(?:language_model\.model|model\.language_model)\.", 1)
            if pattern.startswith(r"model\.")
            else r"(?:language_model\.)?" + pattern,
            f"decoder.{ours}",
        )
        for pattern, ours in key_map
    )


@dataclass(frozen=True)
class AudioSpec:
    config: AudioConfig
    # config.json (the whole composite one) -> the encoder's config
    config_from_checkpoint: Callable[[dict], AudioConfig]
    preprocessing: AudioProcessing  # defaults for a checkpoint without processor files
    audio_token_id: int  # the id of `[AUDIO]`, whose positions take the audio's embeddings
