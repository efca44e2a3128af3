"""Image preprocessing of the runtime, equal to the Hugging Face image processor of each family.

CLIP (LLaVA-1.5, `CLIPImageProcessor`, PIL backend, `kind="clip"`): RGB as below, the shortest
edge resized to `shortest_edge` (BICUBIC; the other edge truncated), a centred S x S crop; the
prompt's `<image>` becomes N `<image>` tokens.

InternVL (`GotOcr2ImageProcessor` with `crop_to_patches`, `kind="internvl"`): RGB, the grid of
at most `max_tiles` S x S tiles whose aspect ratio is closest to the image's (ties: more tiles while
they cover under twice the image's area), the image resized onto it (BICUBIC) and cut row-major,
plus the whole image at S x S when there is more than one tile; the prompt's `<image>` becomes
`<img>`, N `<IMG_CONTEXT>` per frame, `</img>`.

Qwen2-VL / Qwen2.5-VL (`Qwen2VLImageProcessor`, PIL backend, `kind="qwen2_vl"`): each image
resized (BICUBIC) to its `smart_resize` size, multiples of 28 px within `shortest_edge` ..
`longest_edge` pixels (here pixel counts, its `min_pixels` / `max_pixels`), as transformers does:
the grid, and the image's N = H x W / 28² tokens, follow the image. A program's tower takes any
such size with sides from 56 px to S (its dynamic shapes' bound: S, the largest multiple of 28 up
to sqrt(2 x max_pixels), so that every aspect ratio up to 2:1 fits, capped by the entry). A size
outside that range (a longer aspect ratio, or a max_pixels beyond S²) is scaled, keeping the
aspect ratio, until its long side is S and its short side at least 56 px: there transformers
would give more tokens. The prompt's `<image>` becomes `<|vision_start|>`, N `<|image_pad|>`,
`<|vision_end|>` (the chat template writes the markers itself around one `<|image_pad|>`).

Gemma 3 (`Gemma3ImageProcessor`, `kind="gemma3"`): RGB, resized to S x S (BILINEAR). With
pan-and-scan (`do_pan_and_scan`): an image whose long edge is at least `min_crop_ratio` times its
short one is also cut along the long edge into 2 to `max_tiles` equal crops (about one per aspect
ratio unit, each at least `min_crop_size` px, else none), each resized to S x S after the whole
image. The prompt's `<start_of_image>` becomes `\n\n<start_of_image>`, N `<image_soft_token>`,
`<end_of_image>\n\n`; with crops, "Here is the original image" before the whole image's and "and
here are some crops to help you see better" before the crops', as Gemma3Processor writes them.

Idefics3 / SmolVLM (`Idefics3ImageProcessor`, PIL backend), step by step:
1. RGB: an image with alpha (or a transparency key) is composited onto white, anything else
   (grayscale, palette, CMYK, 16-bit) converted by Pillow, as transformers' `convert_to_rgb`.
2. Resize (LANCZOS) so the longest edge is `longest_edge`, the other edge rounded to even, both
   capped at 4096.
3. With splitting: resize each edge up to a multiple of the tile size S, cut row-major S x S tiles,
   and add the whole image resized to S x S (the global image). An image that is one tile after
   the resize is that tile only. Without splitting: resize to S x S.
4. Rescale and normalise: inside the program (`models/vision.py`), so frames stay uint8 here.
The prompt gets, per image, `<fake_token_around_image><row_r_col_c><image>×N` per tile (a newline
after each row), then `\\n<fake_token_around_image><global-img><image>×N<fake_token_around_image>`;
an unsplit image gets the last part without the leading newline.

Pillow resizes, as transformers does, so the pixels are identical (image_files.py decodes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from genai_pipeline.errors import InputError
from genai_pipeline.image_files import pillow
from genai_pipeline.media_placeholders import expand_placeholders

MAX_IMAGE_SIZE = 4096  # transformers' Idefics3 cap on either edge after the first resize
LANCZOS = 1  # PIL.Image.Resampling.LANCZOS, the value processor configs store as `resample`
QWEN_FACTOR = 28  # Qwen2-VL: patch 14 x merge 2, what `smart_resize` rounds to


@dataclass(frozen=True)
class ImageProcessing:
    """What a family's Hugging Face processor does to an image and its prompt: the registry entry's
    defaults, overridden by a checkpoint's processor files (checkpoints/processor.py); carried into
    the manifest."""

    tile_size: int  # S: the encoder's input, `max_image_size.longest_edge` (CLIP: `crop_size`)
    longest_edge: int  # `size.longest_edge`: the first resize (Idefics3); Qwen2-VL: max_pixels
    tokens_per_image: (
        int  # N: `<image>` tokens per frame (processor `image_seq_len`); Qwen2-VL: an S x S frame's, the most
    )
    kind: str = "idefics3"  # which processor: "idefics3", "clip", "internvl", "gemma3" or "qwen2_vl"
    shortest_edge: int = 0  # CLIP: `size.shortest_edge`, the resize before the centre crop; Qwen2-VL: min_pixels
    do_resize: bool = True
    do_image_splitting: bool = True  # InternVL: `crop_to_patches`; Gemma 3: `do_pan_and_scan`
    resample: int = LANCZOS
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    max_tiles: int = 0  # Idefics3: 0 no cap beyond `longest_edge`, else the first resize shrinks until tiles fit; InternVL: `max_patches`
    min_tiles: int = 1  # InternVL: `min_patches`
    # Gemma 3's pan-and-scan (`max_tiles`: `pan_and_scan_max_num_crops`, the crops besides the whole image)
    min_crop_size: int = 0  # `pan_and_scan_min_crop_size`: px of a crop's shorter edge, at least
    min_crop_ratio: float = 0.0  # `pan_and_scan_min_ratio_to_activate`: the aspect ratio that starts cropping
    placeholder: str = "<image>"  # what marks an image's place in a user's prompt
    image_token: str = "<image>"  # the token whose positions take the image's embeddings
    image_start: str = ""  # InternVL: `<img>` before an image's tokens, `</img>` after
    image_end: str = ""
    fake_image_token: str = "<fake_token_around_image>"
    global_image_token: str = "<global-img>"

    def __post_init__(self):
        first_resize = {
            "idefics3": ("longest_edge",),
            "clip": ("shortest_edge",),
            "internvl": (),
            "gemma3": (),
            "qwen2_vl": (),
        }
        if self.kind not in first_resize:
            raise ValueError(f"ImageProcessing.kind must be one of {', '.join(first_resize)}, got '{self.kind}'")
        first_resize = first_resize[self.kind]
        for name in ("tile_size", "tokens_per_image", *first_resize):
            if getattr(self, name) <= 0:
                raise ValueError(f"ImageProcessing.{name} must be positive, got {getattr(self, name)}")
        if self.kind == "gemma3" and self.do_image_splitting and self.min_crop_size <= 0:
            raise ValueError(f"pan-and-scan needs a positive minimum crop size, got {self.min_crop_size}")
        if self.max_tiles < 0:
            raise InputError(f"--max-tiles must be >= 0, got {self.max_tiles}")
        for name in ("image_mean", "image_std"):
            object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))

    @classmethod
    def from_dict(cls, data: dict) -> ImageProcessing:
        return cls(**data)


# ---------------------------------------------------------------- frames


def resize(image: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """[H, W, 3] uint8 resized by Pillow, as transformers' PIL backend does; same size: unchanged."""
    if image.shape[:2] == (height, width):
        return image  # Pillow returns a copy then: identical pixels
    Image = pillow()
    if Image is None:
        raise InputError(
            f"this image must be resized ({image.shape[1]}x{image.shape[0]} -> {width}x{height}), which needs Pillow (pip install pillow)"
        )
    return np.array(Image.fromarray(image).resize((width, height), resample=resample))


def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' `_resize_output_size_rescale_to_max_len` then `..._scale_below_upper_bound`."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """transformers' `resize_for_vision_encoder`: both edges up to multiples of the tile size."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def _first_resize(height: int, width: int, p: ImageProcessing) -> tuple[int, int]:
    """Step 2's size. `max_tiles` lowers its longest edge by whole tiles until the tile count fits
    (transformers has no such cap: a smaller `size.longest_edge` is what it amounts to)."""
    longest, s = p.longest_edge, p.tile_size
    while True:
        h, w = _longest_edge_size(height, width, longest)
        if not (p.do_image_splitting and p.max_tiles) or longest <= s:
            return h, w
        th, tw = _tile_multiple_size(h, w, s)
        if (th // s) * (tw // s) <= p.max_tiles:
            return h, w
        longest -= s


@dataclass(frozen=True)
class Frames:
    """One image's encoder inputs: uint8 [3, S, S] each, tiles row-major then the global image."""

    pixels: tuple[np.ndarray, ...]
    rows: int  # 0 and 0: not split, one frame
    cols: int


def image_frames(image: np.ndarray, p: ImageProcessing) -> Frames:
    """An RGB uint8 [H, W, 3] image as the encoder's frames (Idefics3: steps 2-3)."""
    s = p.tile_size
    if p.kind == "clip":
        return Frames(
            (
                _chw(
                    _centre_crop(resize(image, *_shortest_edge_size(*image.shape[:2], p.shortest_edge), p.resample), s)
                ),
            ),
            0,
            0,
        )
    if p.kind == "internvl":
        return _internvl_frames(image, p)
    if p.kind == "qwen2_vl":
        return Frames((_chw(resize(image, *qwen_size(*image.shape[:2], p), p.resample)),), 0, 0)
    if p.kind == "gemma3":
        crops, rows, cols = _pan_and_scan(image, p) if p.do_image_splitting else ([], 0, 0)
        return Frames(tuple(_chw(resize(i, s, s, p.resample)) for i in [image, *crops]), rows, cols)
    if p.do_resize:
        image = resize(image, *_first_resize(*image.shape[:2], p), p.resample)
    if not p.do_image_splitting:
        return Frames((_chw(resize(image, s, s, p.resample)),), 0, 0)
    image = resize(image, *_tile_multiple_size(*image.shape[:2], s), p.resample)
    h, w = image.shape[:2]
    if h <= s and w <= s:
        return Frames((_chw(image),), 0, 0)
    rows, cols = h // s, w // s
    tiles = [image[r * s : (r + 1) * s, c * s : (c + 1) * s] for r in range(rows) for c in range(cols)]
    return Frames(tuple(_chw(t) for t in [*tiles, resize(image, s, s, p.resample)]), rows, cols)


def _closest_grid(height: int, width: int, p: ImageProcessing) -> tuple[int, int]:
    """transformers' `get_optimal_tiled_canvas`: (columns, rows)."""
    grids = sorted(
        (
            (w, h)
            for w in range(1, p.max_tiles + 1)
            for h in range(1, p.max_tiles + 1)
            if p.min_tiles <= w * h <= p.max_tiles
        ),
        key=lambda g: g[0] * g[1],
    )
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for grid in grids:
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best, best_diff = grid, diff
        elif diff == best_diff and area > 0.5 * p.tile_size * p.tile_size * grid[0] * grid[1]:
            best = grid
    return best


def _internvl_frames(image: np.ndarray, p: ImageProcessing) -> Frames:
    s = p.tile_size
    if not p.do_image_splitting or p.max_tiles <= 1:
        return Frames((_chw(resize(image, s, s, p.resample)),), 0, 0)
    cols, rows = _closest_grid(*image.shape[:2], p)
    canvas = resize(image, rows * s, cols * s, p.resample)
    tiles = [canvas[r * s : (r + 1) * s, c * s : (c + 1) * s] for r in range(rows) for c in range(cols)]
    if len(tiles) > 1:
        tiles.append(resize(image, s, s, p.resample))
    return Frames(tuple(_chw(t) for t in tiles), rows, cols)


def qwen_tile_size(max_pixels: int, cap: int) -> int:
    """Qwen2-VL: the program's largest side, the largest multiple of 28 px up to sqrt(2 x
    `max_pixels`) (the long side `smart_resize` gives a 2:1 image), at most `cap`."""
    return min(cap, math.isqrt(2 * max_pixels) // QWEN_FACTOR * QWEN_FACTOR)


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL `smart_resize`: both sides multiples of 28 px, the area within
    min_pixels .. max_pixels, the aspect ratio kept as closely as that allows."""
    f = QWEN_FACTOR
    if max(height, width) / min(height, width) > 200:
        raise InputError(f"a {width} x {height} image: Qwen2-VL takes aspect ratios up to 200:1")
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h, w


def qwen_size(height: int, width: int, p: ImageProcessing) -> tuple[int, int]:
    """The size a Qwen2-VL program's tower takes for an image: `smart_resize`'s, unless a side falls
    outside 56 .. S px (see the module doc)."""
    h, w = smart_resize(height, width, p.shortest_edge, p.longest_edge)
    s, f = p.tile_size, QWEN_FACTOR
    if h > s and h >= w:
        h, w = s, w * s // (h * f) * f
    elif w > s:
        h, w = h * s // (w * f) * f, s
    return max(2 * f, h), max(2 * f, w)


def frame_tokens(frame: np.ndarray, p: ImageProcessing) -> int:
    """The tokens the tower makes of one frame, uint8 [3, H, W]: its grid's for Qwen2-VL (28 px
    each), else the fixed count."""
    if p.kind == "qwen2_vl":
        return (frame.shape[1] // QWEN_FACTOR) * (frame.shape[2] // QWEN_FACTOR)
    return p.tokens_per_image


def _pan_and_scan(image: np.ndarray, p: ImageProcessing) -> tuple[list[np.ndarray], int, int]:
    """transformers' Gemma3ImageProcessor.pan_and_scan: (crops row-major, rows, columns); no crops: 0, 0."""
    height, width = image.shape[:2]
    long, short = max(height, width), min(height, width)
    if long / short < p.min_crop_ratio:
        return [], 0, 0
    n = min(int(math.floor(long / short + 0.5)), int(math.floor(long / p.min_crop_size)))  # half rounds up
    n = min(p.max_tiles, max(2, n))
    if n < 1:  # a cap of no crops (transformers divides by it)
        return [], 0, 0
    rows, cols = (1, n) if width >= height else (n, 1)
    crop_h, crop_w = math.ceil(height / rows), math.ceil(width / cols)
    if min(crop_h, crop_w) < p.min_crop_size:
        return [], 0, 0
    crops = [
        image[r * crop_h : (r + 1) * crop_h, c * crop_w : (c + 1) * crop_w] for r in range(rows) for c in range(cols)
    ]
    return crops, rows, cols


def _shortest_edge_size(height: int, width: int, shortest: int) -> tuple[int, int]:
    """transformers' `get_resize_output_image_size(..., default_to_square=False)`."""
    if width <= height:
        return int(shortest * height / width), shortest
    return shortest, int(shortest * width / height)


def _centre_crop(image: np.ndarray, size: int) -> np.ndarray:
    """transformers' `center_crop` of an image at least `size` on both edges."""
    h, w = image.shape[:2]
    top, left = (h - size) // 2, (w - size) // 2
    return image[top : top + size, left : left + size]


def _chw(image: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(image.transpose(2, 0, 1))


# ---------------------------------------------------------------- prompt


def image_prompt(frames: Frames, p: ImageProcessing) -> str:
    """The text standing for one image: transformers' `get_image_prompt_string` (Idefics3), or the
    image token N times (LLaVA)."""
    run = p.image_token * (frame_tokens(frames.pixels[0], p) if frames.pixels else p.tokens_per_image)
    if p.kind == "clip":
        return run
    if p.kind in ("internvl", "qwen2_vl"):
        return f"{p.image_start}{run * len(frames.pixels)}{p.image_end}"
    if p.kind == "gemma3":
        one = f"\n\n{p.image_start}{run}{p.image_end}\n\n"
        if len(frames.pixels) == 1:
            return one
        crops = " ".join([one] * (len(frames.pixels) - 1))
        return f"Here is the original image {one} and here are some crops to help you see better {crops}"
    whole = f"{p.fake_image_token}{p.global_image_token}{run}{p.fake_image_token}"
    if frames.rows == 0 and frames.cols == 0:
        return whole
    text = ""
    for r in range(frames.rows):
        for c in range(frames.cols):
            text += f"{p.fake_image_token}<row_{r + 1}_col_{c + 1}>{run}"
        text += "\n"
    return f"{text}\n{whole}"


def expand_prompt(prompt: str, images: list[Frames], p: ImageProcessing) -> str:
    """Each `<image>` of the prompt replaced by the next image's text; with none in the prompt,
    the images go first. More or fewer placeholders than images is an error."""
    return expand_placeholders(
        prompt, [image_prompt(f, p) for f in images], p.placeholder, "image(s)", "--image", "the images"
    )


def expand_rendered_chat(text: str, images: list[Frames], p: ImageProcessing) -> str:
    """A rendered chat's image marks replaced, in order, by the images' text. A chat template
    marks an image part with the placeholder (SmolVLM's and LLaVA's write `<image>`) or with the
    image token itself (InternVL's writes `<IMG_CONTEXT>`, which its processor expands); the
    count must be the conversation's images. Qwen2-VL's writes the markers too
    (`<|vision_start|><|image_pad|><|vision_end|>`): that whole mark is replaced."""
    marked = f"{p.image_start}{p.image_token}{p.image_end}"
    mark = p.placeholder if p.placeholder in text or not images else marked if marked in text else p.image_token
    found = text.count(mark)
    if found != len(images):
        raise InputError(
            f"the chat template wrote {found} {mark} for {len(images)} image(s) of the conversation: "
            "it does not place image parts where this model's processor expects them"
        )
    pieces = text.split(mark)
    return pieces[0] + "".join(image_prompt(f, p) + rest for f, rest in zip(images, pieces[1:]))
