"""Limits on what untrusted input may ask of this machine, each checked before the work it bounds.

Users feed the tool files they downloaded (checkpoints, chat templates, images, data); every size
such a file declares is checked here first, so a hostile or broken file ends in one clear line
instead of a hang or a killed process. Each limit can be raised with the environment variable
named beside it (docs/limits.md lists them all, with the limits that come from this machine).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from genai_pipeline.errors import InputError


@dataclass(frozen=True)
class Limit:
    variable: str  # the environment variable that raises it
    default: int
    unit: str

    def value(self) -> int:
        given = os.environ.get(self.variable, "")
        if not given:
            return self.default
        if not given.isdigit() or int(given) < 1:
            raise InputError(f"{self.variable} must be a whole number of {self.unit} above 0, got '{given}'")
        return int(given)


# Pixels an image file may declare, checked from its header before it is decoded: Pillow's own
# default (a 12 MP photo is 12 M; a decompression bomb declares billions in a few bytes).
IMAGE_PIXELS = Limit("GENAI_MAX_IMAGE_PIXELS", 89_478_485, "pixels")
# Bytes of a text or JSON input read whole (calibration data, --text, --prompt-file, --images).
INPUT_BYTES = Limit("GENAI_MAX_INPUT_BYTES", 1 << 30, "bytes")
# What one HTTP request to `genai serve` may hold: its body is read whole, with its images as
# base64 `data:` URLs (a 12 MP PNG is a few tens of MB), and comes from whoever reaches the port,
# so the body's bound is far below INPUT_BYTES, the bound of a file the user chose.
REQUEST_BYTES = Limit("GENAI_MAX_REQUEST_BYTES", 64 << 20, "bytes")
REQUEST_MESSAGES = Limit("GENAI_MAX_REQUEST_MESSAGES", 1024, "messages")
REQUEST_PARTS = Limit("GENAI_MAX_REQUEST_PARTS", 1024, "content parts")  # of all its messages
REQUEST_IMAGES = Limit("GENAI_MAX_REQUEST_IMAGES", 16, "images")  # each is decoded, up to IMAGE_PIXELS
# Requests waiting for a session of `genai serve`: more are turned away (HTTP 429) at once.
QUEUED_REQUESTS = Limit("GENAI_MAX_QUEUED_REQUESTS", 64, "requests")


def check_image_pixels(source, width: int, height: int) -> None:
    """Refuse an image that declares more pixels than IMAGE_PIXELS, before it is decoded."""
    limit = IMAGE_PIXELS.value()
    if width * height > limit:
        raise InputError(
            f"image '{source}' declares {width} x {height} = {width * height:,} pixels, over the limit of "
            f"{limit:,}; shrink it, or raise the limit with {IMAGE_PIXELS.variable}=N"
        )


def read_input_text(path, what: str, error=InputError, errors: str = "strict") -> str:
    """A UTF-8 text file read whole, once its size is known to be within INPUT_BYTES."""
    if not os.path.isfile(path):
        raise error(f"{what} '{path}' does not exist or is not a file")
    size, limit = os.stat(path).st_size, INPUT_BYTES.value()
    if size > limit:
        raise error(
            f"{what} '{path}' is {size:,} bytes, over the limit of {limit:,}; pass a smaller file, or raise "
            f"the limit with {INPUT_BYTES.variable}=N"
        )
    try:
        with open(path, encoding="utf-8", errors=errors) as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise error(f"{what} '{path}' is not UTF-8 text (bad byte at offset {e.start})") from None
