"""The multimodal path, SmolVLM / Idefics3 family, end to end on a tiny random checkpoint saved by
transformers: our loader, eager parity with transformers (vision features, logits, greedy tokens),
one three-method program (parity, weight sharing), `genai run --image`, ExecuTorch's own
MultimodalRunner, preprocessing against transformers' processor, and bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from genai_pipeline.checkpoints.multimodal import load_multimodal
from genai_pipeline.image_processing import ImageProcessing, expand_prompt, image_frames
from genai_pipeline.inspect import inspect_program
from genai_pipeline.prepare.multimodal import read_processing
from genai_pipeline.registry import get_spec, infer_spec

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
]
SPECIALS += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
SPECIALS += ["<img>", "</img>", "<IMG_CONTEXT>"]  # InternVL's (tests/e2e/test_internvl.py)
VOCAB = 384
IMAGE = 32  # px: the encoder's input; patch 8 -> 4 x 4 patches, shuffled by 2 -> 4 tokens per image
MAX_SEQ = 96
PROMPT = "Describe the picture:"
NEW_TOKENS = 12


def tokenizer(path: Path, specials: list[str] = SPECIALS, vocab: int = VOCAB, bos: str = "<|im_start|>") -> None:
    """Byte-level BPE with the family's special tokens as contiguous ids from 0 (as ExecuTorch's runner
    needs), `bos` put before every text."""
    import pydoc_data.topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["\n".join(sorted(pydoc_data.topics.topics.values()))[:100_000]], trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, specials.index(bos))])
    tok.save(str(path))


def save_tiny_smolvlm(folder: Path) -> Path:
    import transformers

    tokenizer(folder / "tokenizer.json")
    config = transformers.Idefics3Config(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE,
            patch_size=8,
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
        scale_factor=2,
        image_token_id=SPECIALS.index("<image>"),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08) if "norm" not in name else p.normal_(1.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    # The processor's files as transformers 5.x saves them: one processor_config.json, the image processor's
    # settings nested in it (no preprocessor_config.json; tests/checkpoints/test_processor.py reads both layouts).
    # SmolVLM's settings (splitting on, LANCZOS, mean = std = 0.5) at this size: an image of IMAGE px is one
    # frame that needs no resizing. Only processor_config.json is kept: the tokenizer stays the one made above.
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    processor = transformers.Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            size={"longest_edge": IMAGE}, max_image_size={"longest_edge": IMAGE}, resample=1
        ),
        tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json")),
        image_seq_len=4,
    )
    processor.save_pretrained(folder / "processor")
    (folder / "processor" / "processor_config.json").replace(folder / "processor_config.json")
    shutil.rmtree(folder / "processor")
    return folder


# Other test modules import these fixtures (test_vision_split.py, test_vision_chat.py); pytest then
# gives each importing module its own copy of a session fixture, so what they build is kept here:
# built once per session.
SESSION: dict[str, object] = {}


def once(key: str, build):
    if key not in SESSION:
        SESSION[key] = build()
    return SESSION[key]


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return once("checkpoint", lambda: save_tiny_smolvlm(tmp_path_factory.mktemp("smolvlm")))


@pytest.fixture(scope="session")
def reference(checkpoint):
    import transformers

    return transformers.Idefics3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def ours(checkpoint):
    spec = infer_spec(json.loads((checkpoint / "config.json").read_text()))
    processing, vision = read_processing(spec, checkpoint)
    return load_multimodal(spec, checkpoint, MAX_SEQ, vision), processing


def photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A natural-looking RGB uint8 image: gradients, a disc, a bar, noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([255 * x / max(w - 1, 1), 255 * y / max(h - 1, 1), 128 + 100 * np.sin((x + y) / 7)], axis=-1)
    disc = (x - w * 0.6) ** 2 + (y - h * 0.4) ** 2 < (min(h, w) * 0.25) ** 2
    img[disc] = (230, 40, 60)
    img[int(h * 0.7) : int(h * 0.8), :] = (20, 20, 160)
    img += rng.normal(0, 12, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def write_ppm(path: Path, image: np.ndarray) -> Path:
    h, w, _ = image.shape
    path.write_bytes(b"P6\n%d %d\n255\n" % (w, h) + image.tobytes())
    return path


def _prompt_ids(
    checkpoint: Path, processing: ImageProcessing, images: list[np.ndarray], text: str = PROMPT
) -> list[int]:
    from tokenizers import Tokenizer

    expanded = expand_prompt(text, [image_frames(i, processing) for i in images], processing)
    return Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(expanded).ids


def printable(text: str) -> str:
    """What ExecuTorch's runner prints of a text: it leaves out bytes that are not (yet) valid UTF-8
    (a decode writes U+FFFD) and control characters."""
    return "".join(c for c in text if c == "\n" or (c.isprintable() and c != "\ufffd"))


def pixel_values(frames: list[np.ndarray]) -> torch.Tensor:
    """What the processor feeds the model for frames needing no resize: rescaled, normalised."""
    x = torch.from_numpy(np.stack(frames)).float() / 255
    return ((x - 0.5) / 0.5).unsqueeze(0)


# ---------------------------------------------------------------- registry and loader


def test_registry_entries_and_inference(checkpoint):
    for name, tokens in (("smolvlm-256m", 64), ("smolvlm-500m", 64), ("smolvlm2-2_2b", 81)):
        spec = get_spec(name)
        assert spec.vision.config.tokens_per_image == spec.vision.preprocessing.tokens_per_image == tokens
    spec = infer_spec(json.loads((checkpoint / "config.json").read_text()))
    assert spec.family == "smolvlm" and "custom" in spec.name  # tiny sizes: the family, named as custom


def test_processing_read_from_checkpoint(ours):
    _, processing = ours
    assert (processing.tile_size, processing.longest_edge, processing.tokens_per_image) == (IMAGE, IMAGE, 4)


# ---------------------------------------------------------------- eager parity


def test_vision_features_match_transformers(ours, reference):
    model, _ = ours
    frame = photo(IMAGE, IMAGE).transpose(2, 0, 1).copy()
    with torch.no_grad():
        expected = reference.model.get_image_features(pixel_values([frame])).pooler_output[0]
        got = model.vision(torch.from_numpy(frame).unsqueeze(0))[0]
    assert got.shape == expected.shape == (4, 64)
    assert (got - expected).abs().max() <= 1e-4


def _eager_logits(model, ids: list[int], frames: list[np.ndarray], image_token_id: int) -> torch.Tensor:
    with torch.no_grad():
        h = model.decoder.embed(torch.tensor([ids]))
        slots = [i for i, t in enumerate(ids) if t == image_token_id]
        features = torch.cat([model.vision(torch.from_numpy(f).unsqueeze(0))[0] for f in frames])
        h[0, slots] = features
        return model.decoder.forward_embeddings(h, torch.tensor([0]))[0, -1]


def test_eager_logits_and_greedy_tokens_match_transformers(ours, reference, checkpoint):
    model, processing = ours
    image = photo(IMAGE, IMAGE)
    ids = _prompt_ids(checkpoint, processing, [image])
    frames = list(image_frames(image, processing).pixels)
    image_token_id = SPECIALS.index("<image>")
    assert ids.count(image_token_id) == 4
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor([ids]), pixel_values=pixel_values(frames)).logits[0, -1]
    got = _eager_logits(model, ids, frames, image_token_id)
    assert expected.abs().max() > 0.5
    assert (got - expected).abs().max() <= 1e-4


def hf_greedy(
    reference, ids: list[int], pixel_values: torch.Tensor, n: int, eos: int, media: str = "pixel_values"
) -> list[int]:
    """transformers' model, greedy, the whole sequence each step (tiny model: cheap and plain);
    `media`: the argument `pixel_values` goes in as (a speech model's: `input_features`)."""
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            token = int(reference(input_ids=torch.tensor([ids]), **{media: pixel_values}).logits[0, -1].argmax())
            if token == eos:
                break
            out.append(token)
            ids.append(token)
    return out


# ---------------------------------------------------------------- the program


@pytest.fixture(scope="session")
def program(checkpoint, tmp_path_factory) -> Path:
    """The default layout, exported once: one program, three methods."""

    def build() -> Path:
        return export_program(checkpoint, tmp_path_factory.mktemp("smolvlm-program"), MAX_SEQ)

    return once("program", build)


@pytest.fixture(scope="session")
def image_file(tmp_path_factory) -> Path:
    return once("image_file", lambda: write_ppm(tmp_path_factory.mktemp("images") / "photo.ppm", photo(IMAGE, IMAGE)))


def test_program_has_the_runner_methods_and_a_manifest(program, checkpoint):
    manifest = json.loads((program / "manifest.json").read_text())
    assert manifest["artifacts"]["multimodal"]["methods"] == ["token_embedding", "text_decoder", "vision_encoder"]
    vision = manifest["vision"]
    assert set(vision["components"]) == {"vision_encoder", "token_embedding", "text_decoder"}
    assert (vision["image_size"], vision["tokens_per_image"], vision["image_token_id"]) == (
        IMAGE,
        4,
        SPECIALS.index("<image>"),
    )
    assert vision["preprocessing"]["do_image_splitting"] and vision["preprocessing"]["image_mean"] == [0.5, 0.5, 0.5]
    assert vision["runner_vocab_size"] == VOCAB  # every special token can be sampled by ExecuTorch's runner
    assert (manifest["bos_id"], manifest["eos_ids"]) == (1, [2])
    # The image settings nested in the checkpoint's processor_config.json (transformers 5.x's layout) reach the
    # manifest, which our runtime reads; the file itself is copied for a runtime that reads it (transformers).
    assert (vision["preprocessing"]["tile_size"], vision["preprocessing"]["longest_edge"]) == (IMAGE, IMAGE)
    assert (program / "processor_config.json").read_bytes() == (checkpoint / "processor_config.json").read_bytes()
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    assert Idefics3ImageProcessorPil.from_pretrained(program).max_image_size == {"longest_edge": IMAGE}


def test_program_logits_match_transformers(program, reference, checkpoint, image_file):
    from genai_pipeline.runtime.multimodal import MultimodalSession
    from genai_pipeline.tokenizer import Tokenizer

    session = MultimodalSession(program, verify=True)
    ids = session.encode_prompt(Tokenizer.from_folder(program), PROMPT, [image_file])
    frames = list(session.frames)
    assert ids == _prompt_ids(checkpoint, session.processing, [photo(IMAGE, IMAGE)])
    got = session.prefill(ids)
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor([ids]), pixel_values=pixel_values(frames)).logits[0, -1]
    assert (got - expected).abs().max() <= 1e-3


def test_program_stores_each_weight_once(program, ours):
    """The bytes the program stores for tensors (constant segment + delegates' named data) are
    <= 1.02x the components' tensors: vision encoder + connector, token embedding, decoder (a tied
    head is the embedding) and their constant tables (RoPE, positions). The rest of the file is
    graphs. Storing a tied table once takes compile's `store_shared_bytes_once` (tied-embedding
    branch): until that is merged, the table is counted twice."""
    from genai_pipeline import compile as compile_stage
    from genai_pipeline.inspect import inspect_program

    model, _ = ours
    table = model.decoder.tok_embeddings.weight
    assert model.decoder.config.tie_embeddings and model.decoder.output.weight.data_ptr() == table.data_ptr()
    tensors = {t.data_ptr(): t for t in model.parameters()}
    tensors.update(
        {b.data_ptr(): b for name, b in model.named_buffers() if "kv_cache" not in name}
    )  # the cache is planned memory
    expected = sum(t.numel() * t.element_size() for t in tensors.values())
    if not hasattr(compile_stage, "store_shared_bytes_once"):
        expected += table.numel() * table.element_size()
    report = inspect_program(program / "multimodal.pte")
    if "weights" in report:  # inspect counts named data read from the constant segment once (tied-embedding branch)
        stored = report["weights"]["bytes"]
        assert report["weights"]["stored_twice_bytes"] == 0
    else:
        stored = report["constant_segment"]["bytes"] + report["named_data"]["bytes"]
    assert expected <= stored <= 1.02 * expected, (stored, expected)


def run(*argv: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "genai_pipeline.cli", "run", *argv, "--json"], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout)


def test_genai_run_matches_transformers_and_executorch_multimodal_runner(program, reference, checkpoint, image_file):
    ours = run(str(program), "--image", str(image_file), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS))
    ids = ours["prompt_tokens"]
    image_token_id = SPECIALS.index("<image>")
    assert ours["image_tokens"] == ids.count(image_token_id) == 4 and ours["vision_encoder_ms"] > 0
    frame = photo(IMAGE, IMAGE).transpose(2, 0, 1).copy()
    expected = hf_greedy(reference, ids, pixel_values([frame]), NEW_TOKENS, eos=2)
    assert ours["tokens"] == expected

    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  kernels the program calls
    from executorch.extension.llm.runner import (
        GenerationConfig,
        MultimodalRunner,
        make_image_input,
        make_token_input,
    )
    from tokenizers import Tokenizer

    first, last = ids.index(image_token_id), len(ids) - ids[::-1].index(image_token_id)
    inputs = [make_token_input(ids[:first]), make_image_input(torch.from_numpy(frame)), make_token_input(ids[last:])]
    runner = MultimodalRunner(str(program / "multimodal.pte"), str(program / "tokenizer.json"))
    pieces, stats = [], []
    runner.generate(
        inputs,
        GenerationConfig(echo=False, max_new_tokens=NEW_TOKENS, temperature=0.0),
        token_callback=pieces.append,
        stats_callback=stats.append,
    )
    assert stats[0].num_prompt_tokens == len(ids)  # 4 image embeddings advanced the position as 4 tokens
    tok = Tokenizer.from_file(str(program / "tokenizer.json"))
    assert pieces == [tok.decode([t], skip_special_tokens=False) for t in ours["tokens"]]
    runners = inspect_program(program / "multimodal.pte")["stock_runners"]
    assert runners == {"TextLLMRunner": "no `forward` or `prefill` method", "MultimodalRunner": None}


# ---------------------------------------------------------------- bad input: one line each


def _error(capsys, *argv: str) -> str:
    from genai_pipeline.cli import main

    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("error: ")
    return err[-1]


def test_missing_corrupt_and_unsupported_images(program, tmp_path, capsys):
    assert "does not exist" in _error(capsys, str(program), "--image", str(tmp_path / "nope.png"), "--prompt", "x")
    truncated = tmp_path / "cut.ppm"
    truncated.write_bytes(b"P6\n32 32\n255\n" + bytes(100))
    assert "truncated" in _error(capsys, str(program), "--image", str(truncated), "--prompt", "x")
    text = tmp_path / "notes.png"
    text.write_text("not an image")
    message = _error(capsys, str(program), "--image", str(text), "--prompt", "x")
    assert "notes.png" in message and ("not an image" in message or "Pillow" in message)


def test_images_and_placeholders_must_pair(program, image_file, capsys):
    message = _error(capsys, str(program), "--image", str(image_file), "--prompt", "<image> and <image>?")
    assert "2 <image> placeholder(s) but 1 image(s)" in message
    message = _error(
        capsys, str(program), "--image", str(image_file), "--image", str(image_file), "--prompt", "just <image>"
    )
    assert "1 <image> placeholder(s) but 2 image(s)" in message


def test_image_given_to_a_text_only_model(export_tiny, image_file, capsys):
    assert "text-only model" in _error(capsys, str(export_tiny("kv")), "--image", str(image_file), "--prompt", "x")


def test_image_tokens_that_do_not_fit_the_context(program, image_file, capsys):
    message = _error(capsys, str(program), *["--image", str(image_file)] * 20, "--prompt", "x")
    assert "80 of them for 20 image(s)" in message and f"context is {MAX_SEQ}" in message


def test_grayscale_netpbm_is_converted(program, tmp_path):
    """A PGM (one channel) reads as RGB with equal channels; Pillow converts the other modes."""
    from genai_pipeline.image_files import read_image

    gray = photo(IMAGE, IMAGE)[..., 0]
    path = tmp_path / "gray.pgm"
    path.write_bytes(b"P5\n# a comment\n%d %d\n255\n" % (IMAGE, IMAGE) + gray.tobytes())
    rgb = read_image(path)
    assert rgb.shape == (IMAGE, IMAGE, 3) and (rgb == gray[..., None]).all()


# ---------------------------------------------------------------- preprocessing vs transformers


def test_prompt_expansion_matches_transformers():
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    from genai_pipeline.image_processing import Frames, image_prompt

    p = ImageProcessing(tile_size=IMAGE, longest_edge=4 * IMAGE, tokens_per_image=4)
    for rows, cols in ((0, 0), (1, 2), (3, 2)):
        frames = Frames(pixels=(), rows=rows, cols=cols)
        assert image_prompt(frames, p) == get_image_prompt_string(
            rows, cols, 4, "<fake_token_around_image>", "<image>", "<global-img>"
        )
    one = Frames(pixels=(), rows=0, cols=0)
    assert expand_prompt("Hi", [one], p) == image_prompt(one, p) + "Hi"  # no placeholder: images first
    assert expand_prompt("a <image> b", [one], p) == f"a {image_prompt(one, p)} b"


PHOTOS = [
    (37, 53, "RGB"),
    (96, 40, "RGB"),
    (64, 64, "L"),
    (50, 81, "RGBA"),
    (70, 30, "CMYK"),
    (45, 45, "I;16"),
    (33, 20, "P"),
]


@pytest.mark.parametrize("h,w,mode", PHOTOS)
def test_frames_equal_transformers_processor_pixel_for_pixel(h, w, mode):
    """Odd sizes, portrait and landscape, grayscale, alpha, CMYK, 16-bit and palette images through
    transformers' Idefics3 processor (PIL backend) and ours: the same frames, tiles and prompt."""
    Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed: transformers' processor needs it")
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from genai_pipeline.image_files import to_rgb

    rgb = Image.fromarray(photo(h, w, seed=h))
    image = {
        "RGB": rgb,
        "L": rgb.convert("L"),
        "CMYK": rgb.convert("CMYK"),
        "P": rgb.convert("P"),
        "I;16": Image.fromarray(photo(h, w)[..., 0].astype(np.uint16) * 200),
        "RGBA": Image.fromarray(np.dstack([photo(h, w), np.linspace(0, 255, h * w).reshape(h, w).astype(np.uint8)])),
    }[mode]
    processing = ImageProcessing(tile_size=IMAGE, longest_edge=2 * IMAGE, tokens_per_image=4)
    hf = Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * IMAGE}, max_image_size={"longest_edge": IMAGE}, do_image_splitting=True, do_pad=False
    )
    out = hf.preprocess([[image]], return_row_col_info=True)
    ours = image_frames(to_rgb(image), processing)
    expected = np.asarray(out["pixel_values"][0])
    got = np.stack([((f / 255.0).astype(np.float32) - 0.5) / 0.5 for f in ours.pixels])
    assert (ours.rows, ours.cols) == (out["rows"][0][0], out["cols"][0][0])
    assert got.shape == expected.shape and np.abs(got - expected).max() <= 1e-6


def test_max_tiles_caps_the_split():
    pytest.importorskip("PIL.Image", reason="Pillow is not installed: resizing needs it")
    p = ImageProcessing(tile_size=IMAGE, longest_edge=4 * IMAGE, tokens_per_image=4)
    image = photo(3 * IMAGE, 4 * IMAGE)
    assert (image_frames(image, p).rows, image_frames(image, p).cols) == (3, 4)
    capped = image_frames(image, ImageProcessing(**{**p.__dict__, "max_tiles": 4}))
    assert capped.rows * capped.cols <= 4 and len(capped.pixels) == capped.rows * capped.cols + 1


def test_program_with_split_images_matches_transformers_fed_by_its_processor(program, reference, tmp_path):
    """Two images of odd sizes, each split into tiles plus its global image, placed by `<image>`:
    our preprocessing and program against transformers' own processor and model."""
    Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed: transformers' processor needs it")
    import transformers

    from genai_pipeline.runtime.multimodal import MultimodalSession
    from genai_pipeline.tokenizer import Tokenizer

    images = [photo(45, 70, seed=1), photo(64, 30, seed=2)]
    paths = [tmp_path / "wide.png", tmp_path / "tall.jpg"]
    for image, path in zip(images, paths):
        Image.fromarray(image).save(path, quality=90)
    prompt = "Compare <image> with <image>:"
    processing = MultimodalSession(program).processing
    processor = transformers.Idefics3Processor(
        image_processor=transformers.models.idefics3.image_processing_pil_idefics3.Idefics3ImageProcessorPil(
            size={"longest_edge": 2 * IMAGE}, max_image_size={"longest_edge": IMAGE}, do_image_splitting=True
        ),
        tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_file=str(program / "tokenizer.json")),
        image_seq_len=4,
    )
    inputs = processor(text=prompt, images=[Image.open(p) for p in paths], return_tensors="pt")
    with torch.no_grad():
        expected = reference(**inputs).logits[0, -1]

    # the checkpoint's processor files say one tile of IMAGE px; this test splits at 2 * IMAGE px
    session = MultimodalSession(program)
    session.processing = ImageProcessing(**{**processing.__dict__, "longest_edge": 2 * IMAGE})
    ids = session.encode_prompt(Tokenizer.from_folder(program), prompt, paths)
    assert ids == inputs["input_ids"][0].tolist() and len(session.frames) > 2
    assert (session.prefill(ids) - expected).abs().max() <= 1e-3


def test_export_refuses_a_tokenizer_that_spells_image_otherwise(checkpoint, tmp_path):
    import shutil

    from genai_pipeline.errors import CheckpointError
    from genai_pipeline.options import PrepareOptions
    from genai_pipeline.prepare import prepare

    folder = Path(shutil.copytree(checkpoint, tmp_path / "ckpt"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "image_token_id": 7}))
    with pytest.raises(CheckpointError, match="image_token_id is 7"):
        prepare(infer_spec(config), PrepareOptions(max_seq_len=MAX_SEQ, checkpoint=folder))


def test_special_tokens_past_the_runners_vocabulary_are_named(caplog):
    from genai_pipeline.prepare.multimodal import check_sampleable

    check_sampleable({"eos[0]": 2, "bos": 1}, runner_vocab=384, logits=384)
    assert not caplog.records
    check_sampleable({"eos[0]": 400}, runner_vocab=390, logits=512)
    assert "eos[0]=400" in caplog.text and "can never produce them" in caplog.text


def export_program(checkpoint: Path, out: Path, max_seq_len: int) -> Path:
    """A vision-language checkpoint exported (fp32, xnnpack) with the entry its config.json names."""
    import genai_pipeline
    from genai_pipeline.options import PrepareOptions

    return genai_pipeline.export(out=out, prepare=PrepareOptions(max_seq_len=max_seq_len, checkpoint=checkpoint)).folder
