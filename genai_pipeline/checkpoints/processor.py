"""A checkpoint's processor settings, in either layout transformers writes them.

transformers 5.x's `ProcessorMixin.save_pretrained` writes one processor_config.json: the
processor's own settings (`image_seq_len`, ...) at its top level, the image processor's nested
under `image_processor`, and no preprocessor_config.json. Earlier versions, and most published
checkpoints, have the image processor's settings flat in preprocessor_config.json (beside a
processor_config.json with the processor's own, if any). With both, processor_config.json's
`image_processor` wins, as in transformers' `ImageProcessingMixin.get_image_processor_dict`.

A speech processor's feature extractor (transformers' `WhisperFeatureExtractor`) is laid out the
same way: nested under `feature_extractor` in processor_config.json (5.x), or flat in
preprocessor_config.json, where its `feature_extractor_type` says what it is.

This is the one reader of those files for every vision and speech family: what they state
overrides the registry entry's `ImageProcessing` defaults (`image_processing`) or
`AudioProcessing` defaults (`audio_processing`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from genai_pipeline.audio_processing import AudioProcessing
from genai_pipeline.errors import CheckpointError
from genai_pipeline.image_processing import QWEN_FACTOR, ImageProcessing, qwen_tile_size

PROCESSOR_FILE = "processor_config.json"
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
RESAVE = "re-save the processor with transformers' save_pretrained"


@dataclass(frozen=True)
class ProcessorFiles:
    """What a checkpoint folder's processor files state, whichever layout they are in."""

    image: dict  # the image processor's settings; {}: none stated, the entry's defaults stand
    origin: str  # where they were read, for messages
    tokens_per_image: int | None  # `<image>` tokens per frame, if processor_config.json states it
    audio: dict = dataclasses.field(default_factory=dict)  # the feature extractor's settings; {}: none stated
    audio_origin: str = "the entry's defaults (no checkpoint)"

    @classmethod
    def read(cls, folder: Path | None) -> ProcessorFiles:
        if folder is None:
            return cls({}, "the entry's defaults (no checkpoint)", None)
        folder = Path(folder)
        processor = _read_json(folder / PROCESSOR_FILE)
        if "image_processor" in processor:
            image = processor["image_processor"]
            if not isinstance(image, dict):
                raise CheckpointError(
                    f"'{folder / PROCESSOR_FILE}': image_processor is a {type(image).__name__}, "
                    f"not the image processor's settings; {RESAVE}"
                )
            origin = f"'{folder / PROCESSOR_FILE}' (image_processor)"
        elif image := _read_json(folder / IMAGE_PROCESSOR_FILE):
            origin = f"'{folder / IMAGE_PROCESSOR_FILE}'"
        else:
            origin = f"the entry's defaults ('{folder}' has no {IMAGE_PROCESSOR_FILE} and no image_processor in {PROCESSOR_FILE})"
        audio, audio_origin = _feature_extractor(folder, processor)
        return cls(image, origin, _stated_tokens(processor, image, folder / PROCESSOR_FILE), audio, audio_origin)


def _feature_extractor(folder: Path, processor: dict) -> tuple[dict, str]:
    """The audio feature extractor's settings and where they were read."""
    if "feature_extractor" in processor:
        audio = processor["feature_extractor"]
        if not isinstance(audio, dict):
            raise CheckpointError(
                f"'{folder / PROCESSOR_FILE}': feature_extractor is a {type(audio).__name__}, "
                f"not the feature extractor's settings; {RESAVE}"
            )
        return audio, f"'{folder / PROCESSOR_FILE}' (feature_extractor)"
    flat = _read_json(folder / IMAGE_PROCESSOR_FILE)
    if "feature_extractor_type" in flat:
        return flat, f"'{folder / IMAGE_PROCESSOR_FILE}'"
    return {}, f"the entry's defaults ('{folder}' states no audio feature extractor)"


# WhisperFeatureExtractor's names -> AudioProcessing's
AUDIO_SETTINGS = {
    "sampling_rate": "sampling_rate",
    "feature_size": "feature_size",
    "n_fft": "n_fft",
    "hop_length": "hop_length",
    "chunk_length": "chunk_length",
    "padding_value": "padding_value",
}


def audio_processing(defaults: AudioProcessing, files: ProcessorFiles) -> AudioProcessing:
    """The entry's audio defaults overridden by what the files state. A feature extractor other than
    Whisper's, or one that normalises or dithers its input, is refused: this runtime would not match it."""
    stated = files.audio
    kind = stated.get("feature_extractor_type", "WhisperFeatureExtractor")
    if kind != "WhisperFeatureExtractor" or stated.get("do_normalize") or stated.get("dither"):
        raise CheckpointError(
            f"{files.audio_origin} asks for a {kind} (do_normalize {stated.get('do_normalize')}, dither "
            f"{stated.get('dither')}); this pipeline computes Whisper's log-mel features, unnormalised and undithered"
        )
    try:
        found = {
            ours: type(getattr(defaults, ours))(stated[theirs])
            for theirs, ours in AUDIO_SETTINGS.items()
            if theirs in stated
        }
        return dataclasses.replace(defaults, **found)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"{files.audio_origin} holds audio settings this pipeline cannot read ({e}); {RESAVE}"
        ) from None


def _stated_tokens(processor: dict, image: dict, path: Path) -> int | None:
    """`<image>` tokens per frame as the processor states them, if it does: Idefics3's
    `image_seq_len`, InternVL's `image_seq_length`, LLaVA's count from `patch_size` (transformers'
    `LlavaProcessor`: patches of the crop, plus `num_additional_image_tokens`, less one for the
    "default" feature strategy)."""
    try:
        for key in ("image_seq_len", "image_seq_length"):
            if key in processor:
                return _positive(processor[key], key)
        patch, crop = processor.get("patch_size"), image.get("crop_size")
        if patch is not None and isinstance(crop, dict):  # LLaVA; a null patch_size: its legacy processor, no count
            patch = _positive(patch, "patch_size")
            tokens = (crop["height"] // patch) * (crop["width"] // patch) + processor.get(
                "num_additional_image_tokens", 0
            )
            return tokens - (processor.get("vision_feature_select_strategy") == "default")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"'{path}' states image tokens this pipeline cannot read ({e}); {RESAVE}") from None
    return None


def _positive(value, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} is {value!r}, not a positive number")
    return value


def image_processing(defaults: ImageProcessing, files: ProcessorFiles) -> ImageProcessing:
    """The entry's defaults overridden by what the files state (transformers' names -> ours)."""
    try:
        processing = dataclasses.replace(defaults, **_stated(files.image, defaults.kind))
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{files.origin} holds image settings this pipeline cannot read ({e!r}); {RESAVE}"
        ) from None
    return _qwen_tile(processing, defaults, files) if processing.kind == "qwen2_vl" else processing


def _qwen_tile(processing: ImageProcessing, defaults: ImageProcessing, files: ProcessorFiles) -> ImageProcessing:
    """Qwen2-VL: the program's largest side from `max_pixels`, at most the entry's (image_processing.py)."""
    side = qwen_tile_size(processing.longest_edge, defaults.tile_size)
    if side < QWEN_FACTOR or processing.shortest_edge > side * side:
        raise CheckpointError(
            f"{files.origin}: min_pixels {processing.shortest_edge} / max_pixels {processing.longest_edge} leave no "
            f"image of sides a multiple of {QWEN_FACTOR} px up to {defaults.tile_size} px; {RESAVE}"
        )
    return dataclasses.replace(processing, tile_size=side)


def _stated(pre: dict, kind: str) -> dict:
    found = {}
    if "max_image_size" in pre:  # Idefics3: the encoder's tiles
        found["tile_size"] = int(pre["max_image_size"]["longest_edge"])
    size = pre.get("size") or {}
    if "longest_edge" in size:
        found["longest_edge"] = int(size["longest_edge"])
    if "shortest_edge" in size:
        found["shortest_edge"] = int(size["shortest_edge"])
    if isinstance(pre.get("crop_size"), dict):  # CLIP: the centre crop
        found["tile_size"] = int(pre["crop_size"]["height"])
    if kind == "qwen2_vl":  # pixel counts; the 4.x files state them at the top level too
        for ours, theirs in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
            if pre.get(theirs) is not None:
                found[ours] = int(pre[theirs])
    if kind == "internvl":
        if "height" in size:
            found["tile_size"] = int(size["height"])
        if "crop_to_patches" in pre:
            found["do_image_splitting"] = bool(pre["crop_to_patches"])
        for ours, theirs in (("min_tiles", "min_patches"), ("max_tiles", "max_patches")):
            if theirs in pre:
                found[ours] = int(pre[theirs])
    if kind == "gemma3":
        found.update(_stated_pan_and_scan(pre, size))
    for key in ("do_resize", "do_image_splitting"):
        if key in pre:
            found[key] = bool(pre[key])
    for key in ("image_mean", "image_std"):
        if key in pre:
            value = pre[key]
            found[key] = (
                tuple(value) * (3 if len(value) == 1 else 1) if isinstance(value, list) else (float(value),) * 3
            )
    if "resample" in pre:
        found["resample"] = int(pre["resample"])
    if "rescale_factor" in pre:
        found["rescale_factor"] = float(pre["rescale_factor"])
    return found


# Gemma3ImageProcessor's names -> ours; Google's files write null for "the processor's default"
PAN_AND_SCAN = {
    "do_pan_and_scan": ("do_image_splitting", bool),
    "pan_and_scan_min_crop_size": ("min_crop_size", int),
    "pan_and_scan_max_num_crops": ("max_tiles", int),
    "pan_and_scan_min_ratio_to_activate": ("min_crop_ratio", float),
}


def _stated_pan_and_scan(pre: dict, size: dict) -> dict:
    found = {ours: kind(pre[theirs]) for theirs, (ours, kind) in PAN_AND_SCAN.items() if pre.get(theirs) is not None}
    if "height" in size:  # Gemma 3 resizes to exactly this size: the encoder's input
        if size["height"] != size.get("width", size["height"]):
            raise ValueError(f"a non-square size {size}")
        found["tile_size"] = int(size["height"])
    return found


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"'{path}' is not valid JSON ({e}); fix it, or {RESAVE}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"'{path}' holds a JSON {type(data).__name__}, not an object of settings; {RESAVE}")
    return data
