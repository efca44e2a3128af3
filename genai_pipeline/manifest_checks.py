"""The checks a manifest's readers rely on (manifest.py): each malformed part named in a short phrase."""

from __future__ import annotations

import dataclasses
import json

from genai_pipeline.audio_processing import AudioProcessing
from genai_pipeline.image_processing import ImageProcessing
from genai_pipeline.models.audio import AudioConfig
from genai_pipeline.models.cache_io import CacheIOContract
from genai_pipeline.models.vision_config import VisionConfig


class Malformed(Exception):
    """What is wrong with a manifest's shape."""


def typed_value(data: dict, key: str, types: tuple[type, ...], required: bool = False):
    """data[key] when it has one of `types` (a bool is no number); None where an optional key is
    absent or null."""
    value = data.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
        raise Malformed(f"'{key}' is {json.dumps(value)[:40]}" if key in data else f"no '{key}'")
    return value


def whole(value, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def has_contract(cache_io: dict | None) -> bool:
    """Whether `cache_io` holds what CacheIOContract.from_manifest reads."""
    return cache_io is not None and all(f.name in cache_io for f in dataclasses.fields(CacheIOContract))


def strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def checked_vision(vision: dict | None) -> dict | None:
    """The checks the readers of `vision` rely on: its layout, image token and the two configs they rebuild."""
    if vision is None:
        return None
    if not isinstance(vision.get("layout"), str) or not whole(vision.get("image_token_id")):
        raise Malformed("vision without its layout and image token id")
    _check_configs(vision, "vision", ImageProcessing, VisionConfig)
    return vision


def checked_audio(audio: dict | None) -> dict | None:
    """The checks the readers of `audio` rely on: its audio token and the two configs they rebuild."""
    if audio is None:
        return None
    if not whole(audio.get("audio_token_id")):
        raise Malformed("audio without its audio token id")
    _check_configs(audio, "audio", AudioProcessing, AudioConfig)
    return audio


def _check_configs(section: dict, name: str, preprocessing, config) -> None:
    """The section's preprocessing and tower config rebuild (their from_dict accepts them)."""
    for key, kind in (("preprocessing", preprocessing), ("config", config)):
        try:
            kind.from_dict(section.get(key))
        except (TypeError, ValueError) as e:
            raise Malformed(f"{name} {key}: {' '.join(str(e).split())[:60]}") from None


def check_fingerprint(checkpoint: dict) -> None:
    """The checks export_folder.check_weights relies on."""
    files = checkpoint.get("files")
    if (
        not isinstance(checkpoint.get("path"), str)
        or not isinstance(files, dict)
        or not all(
            isinstance(f, dict)
            and whole(f.get("bytes"))
            and whole(f.get("mtime_ns"))
            and isinstance(f.get("sha256"), str)
            for f in files.values()
        )
    ):
        raise Malformed("a checkpoint fingerprint without its path, sizes, times and sha256")
