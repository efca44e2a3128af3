"""Preprocessing of real photos, pixel for pixel against transformers' own image processors set up
as the real checkpoints' preprocessor_config.json set them. The photos are scikit-image's
(astronaut, chelsea, coffee: RGB; camera: grayscale), read out of its PyPI wheel by `make test`
into .cache/photos; synthetic images (tests/models) would not show every resampling difference.

Ours: the registry entry's ImageProcessing (what a checkpoint without processor files gets) and
genai_pipeline.image_processing; theirs: transformers' PIL processors with the settings written
out here, from the published configs (HuggingFaceTB/SmolVLM-256M-Instruct, OpenGVLab/InternVL3-1B-hf,
llava-hf/llava-1.5-7b-hf)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import PHOTOS

from genai_pipeline.image_files import read_image
from genai_pipeline.image_processing import image_frames
from genai_pipeline.registry import get_spec

PHOTO_NAMES = ("astronaut", "chelsea", "coffee", "camera")

pytestmark = pytest.mark.skipif(
    not all((PHOTOS / f"{n}.png").is_file() for n in PHOTO_NAMES), reason=f"{PHOTOS} is filled by `make test`"
)


def _theirs(model: str):
    """(transformers' processor, mean, std) as the model's published preprocessor_config.json sets it."""
    if model == "smolvlm-256m":
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        return (
            Idefics3ImageProcessorPil(
                size={"longest_edge": 2048},
                max_image_size={"longest_edge": 512},
                resample=1,
                do_image_splitting=True,
                do_pad=False,
            ),
            (0.5,) * 3,
            (0.5,) * 3,
        )
    if model == "internvl3-1b":
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
        return (
            GotOcr2ImageProcessorPil(
                size={"height": 448, "width": 448},
                crop_to_patches=True,
                min_patches=1,
                max_patches=12,
                resample=3,
                image_mean=mean,
                image_std=std,
            ),
            mean,
            std,
        )
    from transformers import CLIPImageProcessorPil

    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    return (
        CLIPImageProcessorPil(
            size={"shortest_edge": 336},
            crop_size={"height": 336, "width": 336},
            resample=3,
            image_mean=mean,
            image_std=std,
        ),
        mean,
        std,
    )


@pytest.mark.parametrize("model", ["smolvlm-256m", "internvl3-1b", "llava-1_5-7b"])
@pytest.mark.parametrize("photo", PHOTO_NAMES)
def test_real_photos_give_transformers_frames(model, photo):
    from PIL import Image

    path = PHOTOS / f"{photo}.png"
    processor, mean, std = _theirs(model)
    with Image.open(path) as image:
        out = (
            processor.preprocess([[image]], return_row_col_info=True)
            if model == "smolvlm-256m"
            else processor.preprocess(image)
        )
    expected = np.asarray(out["pixel_values"][0] if model == "smolvlm-256m" else out["pixel_values"])
    expected = expected.reshape(-1, *expected.shape[-3:])  # [frames, 3, S, S]

    frames = image_frames(read_image(path), get_spec(model).vision.preprocessing)
    got = (np.stack(frames.pixels) / 255.0 - np.reshape(mean, (1, 3, 1, 1))) / np.reshape(std, (1, 3, 1, 1))
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert np.abs(got - expected).max() <= 1e-5
    if model == "smolvlm-256m":  # the tile grid too: it decides the prompt's <row_r_col_c> marks
        assert (frames.rows, frames.cols) == (out["rows"][0][0], out["cols"][0][0])


QWEN_MAX_PIXELS = 448 * 336  # every photo's smart_resize size fits a program of 448 px sides


def qwen_patches(frame: np.ndarray, mean, std) -> np.ndarray:
    """A uint8 [3, H, W] frame as Qwen2VLImageProcessor's pixel_values: normalised patches, each
    [3 channels, 2 frames, 14, 14], in 2 x 2 merge-block order."""
    x = (frame / 255.0 - np.reshape(mean, (3, 1, 1))) / np.reshape(std, (3, 1, 1))
    rows, cols = frame.shape[1] // 14, frame.shape[2] // 14
    x = x.reshape(3, rows // 2, 2, 14, cols // 2, 2, 14).transpose(1, 4, 2, 5, 0, 3, 6)[:, :, :, :, :, None]
    return np.broadcast_to(x, (*x.shape[:5], 2, 14, 14)).reshape(rows * cols, -1)


@pytest.mark.parametrize("photo", (*PHOTO_NAMES, "coffee-portrait"))
def test_real_photos_give_qwen2_vl_processor_patches(photo):
    """Qwen2.5-VL: each photo at its own smart_resize size (square, 2:3, 3:2), as transformers'
    processor with the same max_pixels gives it: its resize, rescale, normalisation, patch order
    and grid are ours, pixel for pixel."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from genai_pipeline.image_processing import frame_tokens, qwen_tile_size

    entry = get_spec("qwen2_5-vl-3b").vision.preprocessing
    processing = dataclasses.replace(
        entry, longest_edge=QWEN_MAX_PIXELS, tile_size=qwen_tile_size(QWEN_MAX_PIXELS, entry.tile_size)
    )
    rgb = read_image(PHOTOS / f"{photo.removesuffix('-portrait')}.png")
    rgb = np.ascontiguousarray(rgb.transpose(1, 0, 2)) if photo.endswith("-portrait") else rgb
    theirs = Qwen2VLImageProcessorPil(
        min_pixels=entry.shortest_edge,
        max_pixels=QWEN_MAX_PIXELS,
        resample=entry.resample,
        image_mean=entry.image_mean,
        image_std=entry.image_std,
    ).preprocess(Image.fromarray(rgb))
    frame = image_frames(rgb, processing).pixels[0]
    _, rows, cols = theirs["image_grid_thw"][0].tolist()
    assert processing.tile_size == 448 and frame.shape == (3, rows * 14, cols * 14)
    assert frame_tokens(frame, processing) == rows * cols // 4
    expected = np.asarray(theirs["pixel_values"])
    got = qwen_patches(frame, entry.image_mean, entry.image_std)
    assert got.shape == expected.shape and np.abs(got - expected).max() <= 1e-5


def test_qwen2_vl_sizes_past_the_program_keep_their_aspect_ratio():
    """transformers' smart_resize where it fits the program's 56 .. S px sides; beyond, the long
    side S and the aspect ratio kept (the module doc)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from genai_pipeline.image_processing import qwen_size

    p = dataclasses.replace(get_spec("qwen2_5-vl-3b").vision.preprocessing, longest_edge=448 * 448)
    assert p.tile_size == 448
    for height, width in ((300, 451), (100, 100), (448, 448), (61, 97)):
        assert qwen_size(height, width, p) == smart_resize(height, width, 28, p.shortest_edge, 448 * 448)
    assert smart_resize(300, 900, 28, p.shortest_edge, 448 * 448) == (252, 756)
    assert qwen_size(300, 900, p) == (140, 448) and qwen_size(900, 300, p) == (448, 140)
    assert qwen_size(40, 1200, p) == (56, 448)  # 28 px rows would be 1 x 2 patches: 56 is the least


@pytest.mark.parametrize(
    "photo,min_crop,max_crops", [(p, 256, 4) for p in (*PHOTO_NAMES, "coffee-portrait")] + [("chelsea", 128, 3)]
)
def test_real_photos_give_gemma3_pan_and_scan_frames(photo, min_crop, max_crops):
    """google/gemma-3-4b-it's processor (896 px, BILINEAR, mean = std = 0.5) with pan-and-scan on:
    the processor's default crop settings, and smaller crops (which cut chelsea too). coffee-portrait
    is coffee turned on its side (the crops stacked, not side by side)."""
    import dataclasses

    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    portrait = photo.endswith("-portrait")
    rgb = read_image(PHOTOS / f"{photo.removesuffix('-portrait')}.png")
    rgb = np.ascontiguousarray(rgb.transpose(1, 0, 2)) if portrait else rgb
    processor = Gemma3ImageProcessorPil(size={"height": 896, "width": 896}, resample=2)
    out = processor.preprocess(
        Image.fromarray(rgb),
        do_pan_and_scan=True,
        pan_and_scan_min_crop_size=min_crop,
        pan_and_scan_max_num_crops=max_crops,
        pan_and_scan_min_ratio_to_activate=1.2,
    )
    expected = np.asarray(out["pixel_values"])

    processing = dataclasses.replace(
        get_spec("gemma3-4b").vision.preprocessing, do_image_splitting=True, min_crop_size=min_crop, max_tiles=max_crops
    )
    frames = image_frames(rgb, processing)
    got = (np.stack(frames.pixels) / 255.0 - 0.5) / 0.5
    assert len(frames.pixels) == 1 + out["num_crops"][0]
    assert got.shape == expected.shape and np.abs(got - expected).max() <= 1e-5
    if photo in ("coffee", "coffee-portrait") or min_crop == 128:  # 600 x 400, 451 x 300: two crops
        assert (frames.rows, frames.cols) == ((2, 1) if portrait else (1, 2))
