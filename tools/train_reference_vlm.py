#!/usr/bin/env python3
"""Train the tiny vision-language "reference-vlm" model shipped in ``assets/reference-vlm/``.

What the text path's ``reference`` model is to text, this is to images: a real (if tiny) model
whose accuracy can be measured offline, so the multimodal path's figures mean something.

* Architecture: transformers' ``Idefics3ForConditionalGeneration`` (the code SmolVLM uses):
  a SigLIP encoder (72 px images, patch 12, width 128, 3 layers, 4 heads, MLP 512), pixel shuffle
  by 2 and a bias-free linear (9 image tokens of width 256: each is one 2x2 block of patches, which
  is one cell of the images' 3x3 grid), and a Llama decoder started from
  the shipped text reference model (``assets/reference``: 4 layers, width 256, tied embeddings).
  The tokenizer is the reference's byte-level BPE (4096 ids) plus ``<fake_token_around_image>``,
  ``<image>``, ``<global-img>`` as ids 4096-4098, right after the base vocabulary, and the
  decoder's vocabulary (the logits' width) is exactly 4099, so ExecuTorch's MultimodalRunner can
  sample every id. ``do_image_splitting`` is off: one image = one frame = 9 ``<image>`` tokens.
* Data: a synthetic dataset generated here, seeded: 72x72 images of one to three shapes
  (circle, square, triangle, star, diamond) in six colours and several sizes, each in its own
  cell of a 3x3 grid (jittered, never across a cell border), on plain or textured (stripes,
  checks, noise, gradient) near-grey backgrounds; questions with one-word (or two-word) answers:
  the colour of a shape, which shape has a colour, how many of a shape / how many shapes, where a
  shape is (a cell of the 3x3 grid). Every question asked has exactly one right answer.
  Training samples are drawn fresh from seed ``--seed``; the held-out split (``--heldout`` images
  of seed ``--heldout-seed``, one question each, question kinds in rotation) is written as PNGs and
  ``heldout.jsonl`` (``{"image", "prompt", "answer"}``, the image path relative to the jsonl).
* Prompt: exactly what ``genai run DIR --image IMG --prompt QUESTION`` feeds the program:
  ``<|endoftext|>`` + ``<fake_token_around_image><global-img><image>x9<fake_token_around_image>``
  + the question; the target is `` answer`` + ``<|endoftext|>``. The loss is on the target only.
* Training: AdamW, warmup then cosine down to ``--lr-floor`` (0) of the peak, grad clip 1.0, fixed
  step count (reproducible), 1 thread; the image tower and connector at twice the decoder's LR, plus an auxiliary loss on the image
  tokens (see ``train``) that makes the image side see from the first steps. Each training image
  carries ``--questions`` (5) different questions packed into one row (``packed_batch``): the image
  once, then ``Q1 A1<eos>Q2 A2<eos>...``; a 4D attention mask lets every question see the image and
  itself only, and its positions restart right after the image, so each question is exactly the
  one-question sample the program is asked (tested: the same losses), with the answer loss on every
  answer: five answers of supervision per image for about twice a one-question step's time.
  ``--init`` continues from a checkpoint this script saved (a second stage, fresh seed).
* Evaluation: greedy decoding (eager, transformers) on the held-out questions, exact match of the
  stripped answer; written to ``train_report.json`` with the loss curve. The exported program is
  measured by ``bench/vlm_exact_match.py``.

Usage::

    PYTHONPATH=. .venv/bin/python tools/train_reference_vlm.py            # 2000 steps; writes assets/reference-vlm/
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ASSETS = Path(__file__).resolve().parents[1] / "assets"
REFERENCE = ASSETS / "reference"
OUT = ASSETS / "reference-vlm"

IMAGE = 72  # px: a 3x3 grid of 24 px cells
PATCH = 12  # 6x6 patches; pixel shuffle by 2 makes each image token one 2x2 block of patches = one grid cell
SCALE = 2
TOKENS_PER_IMAGE = (IMAGE // PATCH) ** 2 // SCALE**2  # 9, in the grid's row-major order
SPECIALS = ["<fake_token_around_image>", "<image>", "<global-img>"]  # ids 4096, 4097, 4098
EOS = 0  # <|endoftext|>: BOS and EOS, as in the text reference

SHAPES = ["circle", "square", "triangle", "star", "diamond"]
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 20),
    "purple": (140, 40, 170),
    "orange": (250, 130, 0),
}
PLACES = ["top left", "top", "top right", "left", "centre", "right", "bottom left", "bottom", "bottom right"]
KINDS = ["colour", "shape", "count", "count_all", "where"]
DEMO = 4  # held-out row written also as demo.ppm (a "where" question; `make demo` asks row 0, from its PNG)


# ---------------------------------------------------------------- the synthetic dataset


@dataclass(frozen=True)
class Item:
    shape: str
    colour: str
    cell: int  # 0..8, row-major in a 3x3 grid


def _background(rng: random.Random, nrng: np.random.Generator) -> np.ndarray:
    """Muted (low-saturation) colours, so a shape's colour is never the background's."""

    def muted():
        g = rng.randint(60, 200)
        return np.array([g + rng.randint(-8, 8) for _ in range(3)], dtype=np.float32)

    a, b = muted(), muted()
    y, x = np.mgrid[0:IMAGE, 0:IMAGE]
    kind = rng.choice(["plain", "plain", "stripes", "checks", "noise", "gradient"])
    if kind == "plain":
        img = np.broadcast_to(a, (IMAGE, IMAGE, 3)).copy()
    elif kind == "stripes":
        period = rng.randint(4, 10)
        mask = (((x if rng.random() < 0.5 else y) // period) % 2).astype(bool)
        img = np.where(mask[..., None], a, b)
    elif kind == "checks":
        period = rng.randint(4, 12)
        img = np.where((((x // period) + (y // period)) % 2).astype(bool)[..., None], a, b)
    elif kind == "noise":
        img = a + nrng.normal(0, 18, (IMAGE, IMAGE, 3))
    else:
        t = (x if rng.random() < 0.5 else y)[..., None] / (IMAGE - 1)
        img = a * (1 - t) + b * t
    return np.clip(img, 0, 255).astype(np.uint8)


def _draw(image: np.ndarray, item: Item, rng: random.Random) -> np.ndarray:
    from PIL import Image, ImageDraw

    cell = IMAGE / 3
    size = rng.uniform(11, 18)
    jitter = (cell - size) / 4  # half the room in the cell: a shape never sits on a cell border ("where" stays clear)
    cx = (item.cell % 3 + 0.5) * cell + rng.uniform(-jitter, jitter)
    cy = (item.cell // 3 + 0.5) * cell + rng.uniform(-jitter, jitter)
    r = size / 2
    k = 4  # drawn at 4x, then downsampled: smooth edges
    big = Image.fromarray(image).resize((IMAGE * k, IMAGE * k), Image.NEAREST)
    mask = Image.new("L", big.size, 0)
    d = ImageDraw.Draw(mask)
    X, Y, R = cx * k, cy * k, r * k
    if item.shape == "circle":
        d.ellipse([X - R, Y - R, X + R, Y + R], fill=255)
    elif item.shape == "square":
        s = R * 0.9
        d.rectangle([X - s, Y - s, X + s, Y + s], fill=255)
    elif item.shape == "triangle":
        d.polygon([(X, Y - R), (X + R, Y + R * 0.8), (X - R, Y + R * 0.8)], fill=255)
    elif item.shape == "diamond":
        d.polygon([(X, Y - R), (X + R * 0.8, Y), (X, Y + R), (X - R * 0.8, Y)], fill=255)
    else:  # star
        pts = []
        for i in range(10):
            a = -math.pi / 2 + i * math.pi / 5
            rr = R if i % 2 == 0 else R * 0.45
            pts.append((X + rr * math.cos(a), Y + rr * math.sin(a)))
        d.polygon(pts, fill=255)
    colour = tuple(int(np.clip(c + rng.randint(-20, 20), 0, 255)) for c in COLOURS[item.colour])
    big.paste(Image.new("RGB", big.size, colour), (0, 0), mask)
    return np.asarray(big.resize((IMAGE, IMAGE), Image.BOX))


def _plural(shape: str) -> str:
    return shape + "s"


def questions(items: list[Item], kind: str, rng: random.Random) -> tuple[str, str] | None:
    """One (question, answer) of `kind` about the picture, or None if it has no unambiguous one."""
    shapes = [i.shape for i in items]
    colours = [i.colour for i in items]
    if kind == "colour":
        unique = [i for i in items if shapes.count(i.shape) == 1]
        if not unique:
            return None
        i = rng.choice(unique)
        return f"What colour is the {i.shape}?", i.colour
    if kind == "shape":
        unique = [i for i in items if colours.count(i.colour) == 1]
        if not unique:
            return None
        i = rng.choice(unique)
        return f"What shape is {i.colour}?", i.shape
    if kind == "count":
        shape = rng.choice(shapes) if rng.random() < 0.8 else rng.choice(SHAPES)
        return f"How many {_plural(shape)} are there?", str(shapes.count(shape))
    if kind == "count_all":
        return "How many shapes are there?", str(len(items))
    if kind == "where":
        unique = [i for i in items if sum(j.shape == i.shape and j.colour == i.colour for j in items) == 1]
        if not unique:
            return None
        i = rng.choice(unique)
        return f"Where is the {i.colour} {i.shape}?", PLACES[i.cell]
    raise ValueError(kind)


def scene(rng: random.Random) -> tuple[np.ndarray, list[Item]]:
    nrng = np.random.default_rng(rng.getrandbits(32))
    n = rng.choice([1, 2, 2, 3, 3])
    cells = rng.sample(range(9), n)
    items = [Item(rng.choice(SHAPES), rng.choice(list(COLOURS)), c) for c in cells]
    image = _background(rng, nrng)
    for item in items:
        image = _draw(image, item, rng)
    return image, items


def sample_with_items(rng: random.Random, kind: str | None = None) -> tuple[np.ndarray, list[Item], str, str]:
    """An image, what is in it, and one question about it; `kind` None: a random kind that applies."""
    image, items = scene(rng)
    kinds = [kind] if kind else rng.sample(KINDS, len(KINDS))
    for k in kinds:
        qa = questions(items, k, rng)
        if qa:
            return image, items, *qa
    return sample_with_items(rng, kind)


def sample(rng: random.Random, kind: str | None = None) -> tuple[np.ndarray, str, str]:
    """An image and one question about it; `kind` None: a random kind that applies."""
    image, _, question, answer = sample_with_items(rng, kind)
    return image, question, answer


def sample_many(rng: random.Random, n: int) -> tuple[np.ndarray, list[Item], list[tuple[str, str]]]:
    """An image, what is in it, and up to `n` different questions about it (kinds shuffled, every kind that
    applies once, then again with other picks); at least one."""
    image, items = scene(rng)
    qas: list[tuple[str, str]] = []
    for _ in range(3):
        for k in rng.sample(KINDS, len(KINDS)):
            qa = questions(items, k, rng)
            if qa and qa[0] not in {q for q, _ in qas}:
                qas.append(qa)
            if len(qas) == n:
                return image, items, qas
    return image, items, qas


def cell_targets(items: list[Item]) -> tuple[list[int], list[int]]:
    """Per grid cell (= per image token), the colour and the shape in it; 0 for an empty cell."""
    colours, shapes = [0] * 9, [0] * 9
    for i in items:
        colours[i.cell] = 1 + list(COLOURS).index(i.colour)
        shapes[i.cell] = 1 + SHAPES.index(i.shape)
    return colours, shapes


def write_heldout(folder: Path, n: int, seed: int) -> list[dict]:
    """`n` held-out images (question kinds in rotation) as PNGs + heldout.jsonl."""
    from PIL import Image

    rng = random.Random(seed)
    (folder / "heldout").mkdir(parents=True, exist_ok=True)
    rows = []
    for k in range(n):
        image, prompt, answer = sample(rng, KINDS[k % len(KINDS)])
        name = f"heldout/{k:04d}.png"
        Image.fromarray(image).save(folder / name, optimize=True)
        rows.append({"image": name, "prompt": prompt, "answer": answer, "kind": KINDS[k % len(KINDS)]})
    (folder / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # `make demo`'s image, also as binary PPM: the runtime reads that format without Pillow
    demo = np.asarray(Image.open(folder / rows[DEMO]["image"]).convert("RGB"))
    (folder / "demo.ppm").write_bytes(b"P6\n%d %d\n255\n" % (demo.shape[1], demo.shape[0]) + demo.tobytes())
    return rows


# ---------------------------------------------------------------- tokenizer, processor files, model


def make_tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(REFERENCE / "tokenizer.json"))
    base = tok.get_vocab_size()
    tok.add_special_tokens(SPECIALS)
    ids = [tok.token_to_id(t) for t in SPECIALS]
    assert ids == list(range(base, base + len(SPECIALS))), ids
    return tok


def prompt_text(question: str) -> str:
    """What `genai run --image` makes of a prompt without `<image>`: the image first (Idefics3, no splitting)."""
    run = "<image>" * TOKENS_PER_IMAGE
    return f"<fake_token_around_image><global-img>{run}<fake_token_around_image>{question}"


def encode(tok, question: str, answer: str | None = None) -> tuple[list[int], int]:
    """Prompt ids (BOS by the tokenizer's post-processor) + answer ids + EOS; and the prompt's length."""
    ids = tok.encode(prompt_text(question)).ids
    n = len(ids)
    if answer is not None:
        ids = ids + tok.encode(" " + answer, add_special_tokens=False).ids + [EOS]
    return ids, n


def build_model(vocab_size: int, seed: int):
    import torch
    import transformers

    ref = json.loads((REFERENCE / "config.json").read_text())
    text = {
        k: ref[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "rms_norm_eps",
            "head_dim",
        )
    }
    config = transformers.Idefics3Config(
        vision_config=dict(
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=3,
            num_attention_heads=4,
            image_size=IMAGE,
            patch_size=PATCH,
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=vocab_size,
            tie_word_embeddings=True,
            bos_token_id=EOS,
            eos_token_id=EOS,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            **text,
        ),
        scale_factor=SCALE,
        image_token_id=vocab_size - len(SPECIALS) + 1,
        tie_word_embeddings=True,
        bos_token_id=EOS,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(config)
    # The decoder starts from the text reference; the three new rows from the mean embedding.
    from safetensors.torch import load_file

    weights = load_file(str(REFERENCE / "model.safetensors"))
    text_model = model.model.text_model
    with torch.no_grad():
        for name, p in text_model.named_parameters():
            w = weights["model." + name]
            if name == "embed_tokens.weight":
                p[: w.shape[0]] = w
                p[w.shape[0] :] = w.mean(0)
            else:
                p.copy_(w)
        # The connector starts with outputs at the scale of the text embeddings (std ~0.12), not ~4x above.
        model.model.connector.modality_projection.proj.weight.mul_(0.25)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == text_model.embed_tokens.weight.data_ptr()
    return model


def processor_files(folder: Path) -> None:
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Idefics3ImageProcessor",
                "do_convert_rgb": True,
                "do_resize": True,
                "size": {"longest_edge": IMAGE},
                "max_image_size": {"longest_edge": IMAGE},
                "do_image_splitting": False,
                "resample": 1,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "do_pad": True,
            },
            indent=2,
        )
        + "\n"
    )
    (folder / "processor_config.json").write_text(
        json.dumps({"image_seq_len": TOKENS_PER_IMAGE, "processor_class": "Idefics3Processor"}, indent=2) + "\n"
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|endoftext|>",
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": 512,
                "extra_special_tokens": {
                    "image_token": "<image>",
                    "fake_image_token": "<fake_token_around_image>",
                    "global_image_token": "<global-img>",
                },
            },
            indent=2,
        )
        + "\n"
    )


# ---------------------------------------------------------------- training


def pixels(images: list[np.ndarray]):
    """[B, 1, 3, S, S] as the Idefics3 processor gives them: rescaled, normalised with mean = std = 0.5."""
    import torch

    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255
    return ((x - 0.5) / 0.5).unsqueeze(1)


def batch(tok, samples: list[tuple[np.ndarray, str, str]]):
    import torch

    seqs = [encode(tok, q, a) for _, q, a in samples]
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.full((len(seqs), width), EOS, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, (s, n) in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
        labels[b, n : len(s)] = torch.tensor(s[n:])  # the answer and its EOS only
        mask[b, : len(s)] = 1
    return ids, mask, labels, pixels([img for img, _, _ in samples])


def packed_batch(tok, samples: list[tuple[np.ndarray, list[tuple[str, str]]]]):
    """Several questions per image in one row: BOS + the image + Q1 A1 EOS + Q2 A2 EOS + ...; every
    question sees the image and itself only (a 4D mask) and starts at the position it has when asked alone,
    so each (question, answer) is exactly the single-question sample `batch` makes, the image encoded once."""
    import torch

    prefix = tok.encode(prompt_text("")).ids  # BOS + the image block
    p = len(prefix)
    rows = []
    for _, qas in samples:
        ids, labels, pos, seg = list(prefix), [-100] * p, list(range(p)), [0] * p
        for j, (q, a) in enumerate(qas):
            full, n = encode(tok, q, a)
            assert full[:p] == prefix
            part = full[p:]
            ids += part
            labels += [-100] * (n - p) + part[n - p :]
            pos += list(range(p, p + len(part)))
            seg += [j + 1] * len(part)
        rows.append((ids, labels, pos, seg))
    width = max(len(r[0]) for r in rows)
    B = len(rows)
    ids = torch.full((B, width), EOS, dtype=torch.long)
    labels = torch.full((B, width), -100, dtype=torch.long)
    pos = torch.zeros((B, width), dtype=torch.long)
    seg = torch.full((B, width), -1, dtype=torch.long)
    for b, (i, l, q, s_) in enumerate(rows):
        ids[b, : len(i)], labels[b, : len(i)], pos[b, : len(i)], seg[b, : len(i)] = (
            torch.tensor(x) for x in (i, l, q, s_)
        )
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = causal & ((seg[:, :, None] == seg[:, None, :]) | (seg[:, None, :] == 0))
    allowed |= torch.eye(width, dtype=torch.bool)  # padding attends to itself (no empty rows)
    mask = torch.zeros((B, 1, width, width)).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    return ids, mask, labels, pixels([img for img, _ in samples]), pos


def loss_of(model, ids, mask, labels, pix, pos=None):
    import torch.nn.functional as F

    hidden = model.model(input_ids=ids, attention_mask=mask, pixel_values=pix, position_ids=pos).last_hidden_state
    # The head only where there is a target (the answer): a third of a step's time went to 4099-wide logits
    # of prompt positions that the loss ignores.
    targets = labels[:, 1:]
    keep = targets != -100
    return F.cross_entropy(model.lm_head(hidden[:, :-1][keep]), targets[keep])


def greedy(model, tok, image: np.ndarray, question: str, max_new: int = 16) -> str:
    import torch

    ids, _ = encode(tok, question)
    pix = pixels([image])
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(input_ids=torch.tensor([ids + out]), pixel_values=pix).logits[0, -1]
            t = int(logits.argmax())
            if t == EOS:
                break
            out.append(t)
    return tok.decode(out).strip()


def exact_match(model, tok, rows: list[dict], folder: Path) -> dict:
    from PIL import Image

    model.eval()
    hits, per_kind = 0, {}
    for r in rows:
        image = np.asarray(Image.open(folder / r["image"]).convert("RGB"))
        ok = greedy(model, tok, image, r["prompt"]) == r["answer"]
        hits += ok
        k = per_kind.setdefault(r.get("kind", "?"), [0, 0])
        k[0] += ok
        k[1] += 1
    model.train()
    return {
        "exact_match": round(hits / len(rows), 4),
        "n": len(rows),
        "per_kind": {k: round(a / b, 4) for k, (a, b) in sorted(per_kind.items())},
    }


def lr_at(step: int, steps: int, lr: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def train(
    model,
    tok,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    warmup: int = 50,
    log_every: int = 25,
    data: list | None = None,
    on_log=None,
    minutes: float = 0.0,
    vision_lr: float = 0.0,
    cell_weight: float = 0.0,
    questions_per_image: int = 1,
    lr_floor: float = 0.1,
) -> list[dict]:
    """Up to `steps` AdamW steps on fresh samples of seed `seed` (or on `data`, `sample_with_items` or
    `sample_many` tuples, again and again); the loss curve. `questions_per_image` > 1: each fresh image
    comes with up to that many questions, packed in one row (`packed_batch`), the loss on every answer. With `minutes`, the run also stops at that wall-clock budget and the
    cosine schedule follows whichever of the two is closer to completion, so the LR reaches its floor when
    the run stops. `vision_lr`: the image tower's and connector's own peak LR (0: `lr`).

    `cell_weight` > 0 adds an auxiliary loss that teaches the image side to see before the decoder has
    learnt to look: three linear heads read each image token (the connector's output, one grid cell) and
    classify the colour and the shape in that cell (or none) and which cell it is. Without it the decoder learns the answers' priors
    in ~100 steps and the loss then sits on a plateau for a thousand steps with the image unused. The
    heads are dropped after training: the checkpoint is a plain Idefics3 model."""
    import torch
    import torch.nn.functional as F

    rng = random.Random(seed)
    width = model.config.text_config.hidden_size
    heads = torch.nn.ModuleDict(
        {
            "colour": torch.nn.Linear(width, 1 + len(COLOURS)),
            "shape": torch.nn.Linear(width, 1 + len(SHAPES)),
            "place": torch.nn.Linear(width, len(PLACES)),
        }
    )
    image_tokens = []
    hook = model.model.connector.register_forward_hook(lambda module, args, out: image_tokens.append(out))
    groups = []
    for is_image_side, base in ((True, vision_lr or lr), (False, lr)):
        named = [
            (n, p)
            for n, p in model.named_parameters()
            if n.startswith(("model.vision_model.", "model.connector.")) == is_image_side and p.requires_grad
        ]
        groups.append({"params": [p for n, p in named if p.dim() >= 2], "weight_decay": 0.01, "base_lr": base})
        groups.append({"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0, "base_lr": base})
    groups.append(
        {"params": list(heads.parameters()) if cell_weight else [], "weight_decay": 0.0, "base_lr": vision_lr or lr}
    )
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95))
    model.train()
    curve, running, running_cells, start = [], [], [], time.perf_counter()
    for step in range(steps):
        progress = step / steps
        if minutes:
            progress = max(progress, (time.perf_counter() - start) / (60 * minutes))
            if progress >= 1:
                break
        for g in opt.param_groups:
            g["lr"] = lr_at(int(progress * steps), steps, g["base_lr"], warmup, lr_floor)
        if data is not None:  # `sample_many` tuples, or `sample_with_items` ones (one question each)
            samples = [d if len(d) == 3 else (d[0], d[1], [(d[2], d[3])]) for d in data]
        elif questions_per_image > 1:
            samples = [sample_many(rng, questions_per_image) for _ in range(batch_size)]
        else:
            samples = [
                (img, items, [(q, a)]) for img, items, q, a in (sample_with_items(rng) for _ in range(batch_size))
            ]
        image_tokens.clear()
        if questions_per_image > 1 or any(len(qas) > 1 for _, _, qas in samples):
            loss = answer_loss = loss_of(model, *packed_batch(tok, [(img, qas) for img, _, qas in samples]))
        else:
            loss = answer_loss = loss_of(model, *batch(tok, [(img, *qas[0]) for img, _, qas in samples]))
        if cell_weight:
            (tokens,) = image_tokens  # [B, 9, width]
            colours, shapes = (torch.tensor(t) for t in zip(*(cell_targets(items) for _, items, _ in samples)))
            places = torch.arange(9).expand(len(samples), 9)
            cells = sum(
                F.cross_entropy(heads[name](tokens).flatten(0, 1), target.flatten())
                for name, target in (("colour", colours), ("shape", shapes), ("place", places))
            )
            loss = loss + cell_weight * cells
            running_cells.append(cells.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], 1.0)
        opt.step()
        running.append(answer_loss.item())
        if (step + 1) % log_every == 0 or step == 0 or step + 1 == steps:
            curve_lr = lr_at(int(progress * steps), steps, lr, warmup, lr_floor)  # the decoder's
            point = {
                "step": step + 1,
                "loss": round(sum(running) / len(running), 4),
                "lr": round(curve_lr, 6),
                "minutes": round((time.perf_counter() - start) / 60, 2),
            }
            if running_cells:
                point["cell_loss"] = round(sum(running_cells) / len(running_cells), 4)
            curve.append(point)
            running, running_cells = [], []
            if on_log:
                on_log(point)
    if running:  # stopped by the clock between two log points
        curve.append(
            {
                "step": step,
                "loss": round(sum(running) / len(running), 4),
                "lr": round(lr_at(int(progress * steps), steps, lr, warmup, lr_floor), 6),
                "minutes": round((time.perf_counter() - start) / 60, 2),
            }
        )
        if on_log:
            on_log(curve[-1])
    hook.remove()
    return curve


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument(
        "--minutes",
        type=float,
        default=0.0,
        help="also stop at this wall-clock budget (0: none; the default run is a fixed step count)",
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3, help="peak LR of the decoder")
    p.add_argument(
        "--lr-floor", type=float, default=0.0, help="the cosine schedule ends at this fraction of the peak LRs"
    )
    p.add_argument("--vision-lr", type=float, default=2e-3, help="peak LR of the image tower and connector")
    p.add_argument(
        "--cell-weight",
        type=float,
        default=1.0,
        help="weight of the per-cell colour/shape/place loss on the image tokens",
    )
    p.add_argument(
        "--questions",
        type=int,
        default=5,
        help="questions per training image, packed in one row (each sees the image and itself only)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout", type=int, default=240)
    p.add_argument("--heldout-seed", type=int, default=1, help="seed of the held-out images (never a training seed)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared 2-core machine two threads ran 4.8x slower per step)",
    )
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument(
        "--init", type=Path, default=None, help="start from this saved checkpoint instead of the text reference"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    out = args.out
    if args.init and args.init.resolve() == out.resolve():
        raise SystemExit("--init must not be --out (the output folder is emptied first)")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    if args.seed == args.heldout_seed:
        raise SystemExit("--seed must differ from --heldout-seed: the training stream would be the held-out images")
    rows = write_heldout(out, args.heldout, args.heldout_seed)
    tok = make_tokenizer()
    if args.init:  # continue from a checkpoint this script saved (a second stage)
        import transformers

        model = transformers.Idefics3ForConditionalGeneration.from_pretrained(args.init, dtype=torch.float32)
    else:
        model = build_model(tok.get_vocab_size(), args.seed)
    params = sum(p.numel() for p in model.parameters())
    print(f"{params / 1e6:.2f} M parameters; vocab {tok.get_vocab_size()}; {len(rows)} held-out questions", flush=True)
    start, cpu = time.perf_counter(), time.process_time()
    curve = train(
        model,
        tok,
        args.steps,
        args.batch_size,
        args.lr,
        args.seed,
        minutes=args.minutes,
        vision_lr=args.vision_lr,
        cell_weight=args.cell_weight,
        questions_per_image=args.questions,
        lr_floor=args.lr_floor,
        on_log=lambda pt: print(json.dumps(pt), flush=True),
    )
    minutes = (time.perf_counter() - start) / 60
    cpu_minutes = (
        time.process_time() - cpu
    ) / 60  # what the run needs of the machine; wall time also counts its other jobs
    result = exact_match(model, tok, rows, out)
    print(json.dumps(result), flush=True)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tok.save(str(out / "tokenizer.json"))
    processor_files(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": EOS, "eos_token_id": EOS}, indent=2) + "\n")
    report = {
        "params": params,
        "vocab_size": tok.get_vocab_size(),
        "image_tokens": TOKENS_PER_IMAGE,
        "steps": curve[-1]["step"],
        "step_cap": args.steps,
        "minutes_budget": args.minutes,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "lr_floor": args.lr_floor,
        "vision_lr": args.vision_lr,
        "cell_weight": args.cell_weight,
        "questions_per_image": args.questions,
        "seed": args.seed,
        "train_minutes": round(minutes, 2),
        "train_cpu_minutes": round(cpu_minutes, 2),
        "wall_minutes": round((time.perf_counter() - wall) / 60, 2),
        "threads": args.threads,
        "init": str(args.init) if args.init else "assets/reference (decoder) + random image tower",
        "final_loss": curve[-1]["loss"],
        "loss_curve": curve,
        "heldout_eager_greedy": result,
        "torch_version": torch.__version__,
        "command": "PYTHONPATH=. .venv/bin/python tools/train_reference_vlm.py " + " ".join(argv or sys.argv[1:]),
    }
    if args.init and (args.init / "train_report.json").is_file():  # the stages before this one
        report["previous_stage"] = json.loads((args.init / "train_report.json").read_text())
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
