"""Image files as RGB pixels, decoded as transformers decodes them: Pillow, with the size an image
declares checked before anything is decoded (limits.py); without Pillow, binary PPM/PGM only."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np

from genai_pipeline.errors import InputError
from genai_pipeline.limits import check_image_pixels


def pillow():
    try:
        import PIL.Image
    except ImportError:
        return None
    return PIL.Image


def read_image(path: Path) -> np.ndarray:
    """An image file as RGB uint8 [H, W, 3], converted as transformers converts it (step 1)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"image '{path}' does not exist")
    Image = pillow()
    if Image is None:
        if path.suffix.lower() in (".ppm", ".pgm", ".pnm"):
            return read_netpbm(path)
        raise InputError(
            f"cannot read '{path}': reading images needs Pillow (pip install pillow); without it only binary PPM/PGM"
        )
    return decode_image(path, str(path))


def decode_image(source: Path | BinaryIO, name: str) -> np.ndarray:
    """An image file (a path, or its bytes as a file object: a request's data: URL) as RGB uint8
    [H, W, 3], through Pillow; `name` says which image in messages."""
    Image = pillow()
    # Ours replaces Pillow's guard (a warning, then an error at twice its own limit): open() reads
    # only the header, and the size it declares is checked before anything is decoded.
    Image.MAX_IMAGE_PIXELS = None
    try:
        with Image.open(source) as image:
            check_image_pixels(name, *image.size)
            image.load()
            return to_rgb(image)
    except Image.UnidentifiedImageError:
        raise InputError(
            f"'{name}' is not an image file Pillow can read (supported: PNG, JPEG, GIF, BMP, TIFF, WebP, PPM, ...)"
        ) from None
    except (OSError, ValueError, SyntaxError) as e:  # truncated or damaged data
        raise InputError(f"cannot decode image '{name}': {e}; the file is truncated or corrupt") from None


def to_rgb(image) -> np.ndarray:
    """A PIL image as RGB uint8 [H, W, 3]: transformers' `convert_to_rgb` (alpha onto white)."""
    Image = pillow()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.array(Image.alpha_composite(background, rgba).convert("RGB"))
    return np.array(image.convert("RGB"))


def read_netpbm(path: Path) -> np.ndarray:
    """Binary PPM (P6) or PGM (P5), 8-bit: the one format read without Pillow."""
    data = path.read_bytes()
    fields, pos = [], 0
    while len(fields) < 4:  # magic, width, height, maxval; '#' starts a comment
        while pos < len(data) and data[pos : pos + 1].isspace():
            pos += 1
        if data[pos : pos + 1] == b"#":
            pos = data.find(b"\n", pos) + 1 or len(data)
            continue
        end = pos
        while end < len(data) and not data[end : end + 1].isspace():
            end += 1
        if end == pos:
            raise InputError(f"'{path}' is a truncated PPM/PGM file")
        fields.append(data[pos:end])
        pos = end
    magic, size = fields[0], fields[1:]
    if magic not in (b"P5", b"P6") or not all(f.isdigit() for f in size) or int(size[2]) != 255:
        raise InputError(
            f"'{path}' is not an 8-bit binary PPM/PGM file; other formats need Pillow (pip install pillow)"
        )
    w, h, channels = int(size[0]), int(size[1]), 3 if magic == b"P6" else 1
    pixels = (
        np.frombuffer(data, np.uint8, count=w * h * channels, offset=pos + 1)
        if len(data) >= pos + 1 + w * h * channels
        else None
    )
    if pixels is None:
        raise InputError(f"'{path}' is a truncated PPM/PGM file")
    return np.repeat(pixels.reshape(h, w, channels), 3 // channels, axis=2)
