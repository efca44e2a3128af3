"""tools/train_reference_vlm.py: its dataset is reproducible, its prompts are exactly what the
runtime feeds the exported program, its loss is on the answers only, and a few training steps on
a handful of generated samples lower the loss (seconds; the full run is not a test)."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_reference_vlm", ROOT / "tools" / "train_reference_vlm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_dataset_is_seeded(script):
    a = [script.sample(random.Random(3)) for _ in range(2)]
    b = [script.sample(random.Random(3)) for _ in range(2)]
    for (ia, qa, aa), (ib, qb, ab) in zip(a, b):
        assert np.array_equal(ia, ib) and (qa, aa) == (qb, ab)
        assert ia.shape == (script.IMAGE, script.IMAGE, 3) and ia.dtype == np.uint8
    rng = random.Random(0)
    for kind in script.KINDS:
        _, question, answer = script.sample(rng, kind)
        assert question.endswith(("?", ".")) and answer and len(answer.split()) <= 12


def test_heldout_written_as_genai_reads_it(script, tmp_path):
    import json

    rows = script.write_heldout(tmp_path, len(script.KINDS), seed=1)
    lines = [json.loads(line) for line in (tmp_path / "heldout.jsonl").read_text().splitlines()]
    assert lines == rows and [r["kind"] for r in rows] == script.KINDS
    assert all((tmp_path / r["image"]).is_file() and {"image", "prompt", "answer"} <= r.keys() for r in rows)


def test_prompt_is_the_runtimes(script):
    """The training prompt is what `genai run --image` makes of the question (registry entry's processing)."""
    from genai_pipeline.image_processing import expand_prompt, image_frames
    from genai_pipeline.registry import get_spec

    spec = get_spec("reference-vlm")
    processing = spec.vision.preprocessing
    image, question, _ = script.sample(random.Random(0))
    frames = image_frames(image, processing)
    assert len(frames.pixels) == 1 and np.array_equal(frames.pixels[0], image.transpose(2, 0, 1))
    assert expand_prompt(question, [frames], processing) == script.prompt_text(question)
    tok = script.make_tokenizer()
    assert (
        [tok.token_to_id(t) for t in script.SPECIALS] == [4096, 4097, 4098] == list(range(4096, tok.get_vocab_size()))
    )
    assert spec.vision.image_token_id == tok.token_to_id("<image>") and spec.config.vocab_size == tok.get_vocab_size()


def test_loss_is_on_the_answer_only(script):
    tok = script.make_tokenizer()
    rng = random.Random(0)
    samples = [script.sample(rng) for _ in range(3)]
    ids, mask, labels, pix = script.batch(tok, samples)
    assert pix.shape == (3, 1, 3, script.IMAGE, script.IMAGE)
    for b, (_, question, answer) in enumerate(samples):
        target = labels[b][labels[b] != -100].tolist()
        assert target[-1] == script.EOS and tok.decode(target[:-1]).strip() == answer
        assert (ids[b] == 4097).sum() == script.TOKENS_PER_IMAGE


def test_a_few_steps_lower_the_loss(script):
    torch.manual_seed(0)
    tok = script.make_tokenizer()
    model = script.build_model(tok.get_vocab_size(), seed=0)
    assert sum(p.numel() for p in model.parameters()) <= 10_000_000
    rng = random.Random(0)
    data = [script.sample_with_items(rng) for _ in range(4)]
    curve = script.train(
        model,
        tok,
        steps=8,
        batch_size=4,
        lr=1e-3,
        seed=0,
        warmup=1,
        log_every=1,
        data=data,
        vision_lr=2e-3,
        cell_weight=1.0,
    )
    assert curve[-1]["loss"] < 0.5 * curve[0]["loss"], curve
    assert curve[-1]["cell_loss"] < curve[0]["cell_loss"], curve
    # the same with several questions per image, packed (the default recipe)
    model = script.build_model(tok.get_vocab_size(), seed=0)
    rng = random.Random(0)
    data = [script.sample_many(rng, 5) for _ in range(2)]
    curve = script.train(
        model,
        tok,
        steps=8,
        batch_size=2,
        lr=1e-3,
        seed=0,
        warmup=1,
        log_every=1,
        data=data,
        vision_lr=2e-3,
        cell_weight=1.0,
        questions_per_image=5,
    )
    assert curve[-1]["loss"] < 0.5 * curve[0]["loss"], curve
    assert curve[-1]["cell_loss"] < curve[0]["cell_loss"], curve


def test_cell_targets_follow_the_image_tokens(script):
    """Image token k (pixel shuffle's row-major order) covers grid cell k: the auxiliary loss's targets."""
    items = [script.Item("star", "red", 0), script.Item("circle", "blue", 5)]
    colours, shapes = script.cell_targets(items)
    assert colours == [
        1 + list(script.COLOURS).index("red"),
        0,
        0,
        0,
        0,
        1 + list(script.COLOURS).index("blue"),
        0,
        0,
        0,
    ]
    assert shapes == [1 + script.SHAPES.index("star"), 0, 0, 0, 0, 1 + script.SHAPES.index("circle"), 0, 0, 0]
    assert script.TOKENS_PER_IMAGE == 9 and script.IMAGE // script.PATCH == 2 * 3
    model = script.build_model(script.make_tokenizer().get_vocab_size(), seed=0)
    patches = torch.arange(36.0).reshape(1, 36, 1).repeat(1, 1, 128)  # patch i (row-major 6x6) carries the value i
    shuffled = model.model.connector.pixel_shuffle(patches, script.SCALE)[0, :, ::128]  # the 4 patches per token
    for k in range(9):
        rows, cols = {int(v) // 6 for v in shuffled[k]}, {int(v) % 6 for v in shuffled[k]}
        assert rows == {2 * (k // 3), 2 * (k // 3) + 1} and cols == {2 * (k % 3), 2 * (k % 3) + 1}


def test_a_shape_stays_inside_its_cell(script):
    """ "Where is the red star?" has one answer: every drawn pixel lies in the item's grid cell."""
    rng = random.Random(0)
    cell = script.IMAGE / 3
    for k in range(45):
        item = script.Item(script.SHAPES[k % len(script.SHAPES)], "red", k % 9)
        blank = np.full((script.IMAGE, script.IMAGE, 3), 128, np.uint8)
        ys, xs = np.nonzero((script._draw(blank, item, rng) != 128).any(-1))
        row, col = divmod(item.cell, 3)
        assert row * cell <= ys.min() and ys.max() < (row + 1) * cell, item
        assert col * cell <= xs.min() and xs.max() < (col + 1) * cell, item


def test_sample_many_asks_different_questions(script):
    rng = random.Random(0)
    for _ in range(20):
        image, items, qas = script.sample_many(rng, 5)
        assert 1 <= len(qas) <= 5 and len({q for q, _ in qas}) == len(qas)
        assert image.shape == (script.IMAGE, script.IMAGE, 3) and items
    # one item: every kind applies, so five different kinds
    rng = random.Random(1)
    while True:
        image, items, qas = script.sample_many(rng, 5)
        if len(items) == 1:
            break
    assert len(qas) == 5 and qas[0][0] != qas[1][0]
    assert {q.split()[0] + q.split()[1] for q, _ in qas} >= {"Whatcolour", "Whatshape", "Whereis"}


def test_packed_questions_are_the_single_question_samples(script):
    """Several questions packed behind one image: each answer's loss is what the one-question sample
    (the program's prompt) gives, so no question sees another (a 4D mask, positions restarting)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    tok = script.make_tokenizer()
    model = script.build_model(tok.get_vocab_size(), seed=0).eval()
    rng = random.Random(5)
    samples = [script.sample_many(rng, 5) for _ in range(2)]
    assert all(len(qas) > 1 for _, _, qas in samples)

    def per_token(ids, mask, labels, pix, pos=None):
        hidden = model.model(input_ids=ids, attention_mask=mask, pixel_values=pix, position_ids=pos).last_hidden_state
        keep = labels[:, 1:] != -100
        return F.cross_entropy(model.lm_head(hidden[:, :-1][keep]), labels[:, 1:][keep], reduction="none")

    with torch.no_grad():
        packed = script.packed_batch(tok, [(image, qas) for image, _, qas in samples])
        assert packed[0].shape[0] == 2 and packed[1].shape[:2] == (2, 1)
        packed_losses = per_token(*packed)
        single = torch.cat(
            [per_token(*script.batch(tok, [(image, q, a)])) for image, _, qas in samples for q, a in qas]
        )
    assert packed_losses.shape == single.shape and packed_losses.shape[0] > 2 * len(samples)
    assert torch.allclose(packed_losses, single, atol=1e-4), (packed_losses - single).abs().max()
    # and the targets are every answer + its EOS
    labels = packed[2][0]
    answers = [a for _, a in samples[0][2]]
    target = labels[labels != -100].tolist()
    assert target.count(script.EOS) == len(answers)
    assert tok.decode([t for t in target if t != script.EOS]).split() == " ".join(answers).split()


def test_schedule_ends_at_its_floor(script):
    assert script.lr_at(0, 2000, 1e-3, 50) == pytest.approx(1e-3 / 50)
    assert script.lr_at(50, 2000, 1e-3, 50) == pytest.approx(1e-3)
    assert script.lr_at(1999, 2000, 1e-3, 50, floor=0.0) < 1e-8
    assert script.lr_at(1999, 2000, 1e-3, 50, floor=0.1) == pytest.approx(1e-4, rel=1e-3)
