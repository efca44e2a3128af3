"""Vision-language and speech-language checkpoints (Hugging Face folders): text decoder, image or
audio tower and connector read through the entry's key map into one model built on the meta
device, each tensor assigned once (one copy of the weights in memory, as checkpoints/hf.py does
for text models)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from safetensors import safe_open

from genai_pipeline.audio_processing import AudioProcessing
from genai_pipeline.checkpoints.hf import _as_ours, decoder_config, read_config, refuse_non_finite, safetensors_files
from genai_pipeline.errors import CheckpointError
from genai_pipeline.image_processing import ImageProcessing
from genai_pipeline.models.audio import AudioConfig, AudioEncoder, AudioLanguageModel
from genai_pipeline.models.decoder import Decoder, DecoderConfig
from genai_pipeline.models.vision import VisionEncoder, VisionLanguageModel, unused_tower_tensor
from genai_pipeline.models.vision_config import VisionConfig
from genai_pipeline.registry import ModelSpec

TIED_HEAD = "decoder.output.weight"


def vision_config(
    spec: ModelSpec, folder: Path | None, processing: ImageProcessing, processing_origin: str
) -> VisionConfig:
    """The checkpoint's image tower (the entry's without one), normalising as its processor does;
    `processing_origin` says where the processor's settings were read (processor.ProcessorFiles)."""
    config = spec.vision.config if folder is None else _tower(spec, spec.vision, folder, "image tower")
    if spec.vision.size_from_processor:
        config = dataclasses.replace(config, image_size=processing.tile_size)
    if processing.tile_size != config.image_size:
        tower_origin = "config.json's vision_config.image_size" if folder is not None else "the entry"
        raise CheckpointError(
            f"the processor's tiles are {processing.tile_size} px ({processing_origin}) but the image tower takes "
            f"{config.image_size} px ({tower_origin}); this pipeline needs "
            "them equal: fix the one that does not describe the model"
        )
    return dataclasses.replace(
        config,
        image_mean=processing.image_mean,
        image_std=processing.image_std,
        rescale_factor=processing.rescale_factor,
    )


def _tower(spec: ModelSpec, side, folder: Path, what: str):
    """`side` (a VisionSpec or AudioSpec) read from the checkpoint's config.json."""
    try:
        return side.config_from_checkpoint(read_config(folder))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"'{folder}/config.json' does not describe a {spec.family} {what}: {e!r}") from None


def audio_config(
    spec: ModelSpec, folder: Path | None, processing: AudioProcessing, processing_origin: str
) -> AudioConfig:
    """The checkpoint's audio tower (the entry's without one), checked against its feature extractor:
    the encoder's input is one chunk of the extractor's features."""
    config = spec.audio.config if folder is None else _tower(spec, spec.audio, folder, "audio tower")
    made, taken = (processing.feature_size, processing.chunk_frames), (config.n_mels, config.frames)
    if made != taken:
        tower_origin = "config.json's audio_config" if folder is not None else "the entry"
        raise CheckpointError(
            f"the feature extractor makes chunks of {made[0]} mel bins x {made[1]} frames ({processing_origin}) but the "
            f"audio tower takes {taken[0]} x {taken[1]} ({tower_origin}); fix the one that does not describe the model"
        )
    return config


Tower = VisionConfig | AudioConfig
MultimodalModel = VisionLanguageModel | AudioLanguageModel


def build(text: DecoderConfig, tower: Tower, max_seq_len: int) -> MultimodalModel:
    if isinstance(tower, AudioConfig):
        return AudioLanguageModel(Decoder(text, max_seq_len), AudioEncoder(tower))
    return VisionLanguageModel(Decoder(text, max_seq_len), VisionEncoder(tower))


def load_multimodal(spec: ModelSpec, folder: Path, max_seq_len: int, vision: Tower) -> MultimodalModel:
    """`vision`: the image tower's config, or a speech model's audio tower's."""
    folder = Path(folder)
    with torch.device("meta"):
        model = build(decoder_config(spec, folder), vision, max_seq_len)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if model.decoder.config.tie_embeddings:
        expected.pop(TIED_HEAD)
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        state.update(_read_file(spec, file, expected, vision))
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(
            f"checkpoint '{folder}' lacks tensor(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    refuse_non_finite(state, folder)
    model.load_state_dict(state, strict=False, assign=True)
    model.decoder.tie_weights()
    model.decoder.reset_buffers()
    if isinstance(model, VisionLanguageModel):
        model.vision.reset_buffers()
        if model.mrope is not None:
            model.mrope.reset_buffers()
    return model.eval().requires_grad_(False)


def _read_file(
    spec: ModelSpec, file: Path, expected: dict[str, tuple[int, ...]], tower: Tower
) -> dict[str, torch.Tensor]:
    transposed = spec.vision.transposed_keys if spec.vision is not None else ()  # stored [in, out]
    state = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                ours = spec.map_key(key)
                if ours == (TIED_HEAD,) and TIED_HEAD not in expected:
                    continue  # a tied head saved anyway: the embedding is the head
                if len(ours) == 1 and isinstance(tower, VisionConfig) and unused_tower_tensor(ours[0], tower):
                    continue  # e.g. LLaVA's last CLIP layer: the connector reads the one before
                if not ours or any(name not in expected for name in ours):
                    raise CheckpointError(
                        f"unexpected tensor '{key}' in '{file.name}' for a {spec.family} model with this config.json"
                    )
                tensor = f.get_tensor(key)
                if any(re.fullmatch(p, key) for p in transposed):
                    tensor = tensor.t().contiguous()
                if tensor.dim() > len(expected[ours[0]]) and tensor.squeeze().shape == torch.Size(expected[ours[0]]):
                    tensor = tensor.reshape(expected[ours[0]])  # e.g. InternVL's class token [1, 1, d]: the same values
                # several: a fused tensor (Qwen2.5-VL's vision qkv), split by our shapes
                state.update(_as_ours(tensor, key, file.name, {name: expected[name] for name in ours}))
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises several types for a damaged file
        raise CheckpointError(f"cannot read '{file}': {e}; the file is truncated or not safetensors") from None
    return state


def random_multimodal(text: DecoderConfig, vision: Tower, max_seq_len: int, seed: int = 0) -> MultimodalModel:
    """Random weights (std 0.02; norms at one, biases at zero), reproducible from the seed."""
    torch.manual_seed(seed)
    model = build(text, vision, max_seq_len)
    for name, p in model.named_parameters():
        if "norm" in name and name.endswith("weight") or (text.tie_embeddings and name == TIED_HEAD):
            if "norm" in name:
                torch.nn.init.ones_(p)
            continue
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.zeros_(p)
    return model.eval().requires_grad_(False)
