"""InternVL 3 (InternViT with layer scale, pixel shuffle, LayerNorm + MLP connector, Qwen2 decoder)
end to end on a tiny random checkpoint saved by transformers: loader, eager parity, one
three-method program, `genai run --image`, ExecuTorch's MultimodalRunner, tiling against
transformers' GotOcr2 processor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_vision import SPECIALS, VOCAB, export_program, hf_greedy, photo, printable, run, tokenizer, write_ppm

from genai_pipeline.checkpoints.multimodal import load_multimodal
from genai_pipeline.image_processing import Frames, expand_prompt, image_frames, image_prompt
from genai_pipeline.prepare.multimodal import read_processing
from genai_pipeline.registry import infer_spec
from genai_pipeline.registry.internvl import IMAGENET_MEAN, IMAGENET_STD

IMAGE = 28  # px; patch 7 -> 4 x 4 patches, the class token dropped, shuffled by 2 -> 4 tokens per tile
TOKENS = 4
MAX_SEQ = 64
IMAGE_ID = SPECIALS.index("<IMG_CONTEXT>")
PROMPT = "<|im_start|>user\n<image>\nWhat is this?<end_of_utterance>"


@pytest.fixture(scope="session")
def internvl_checkpoint(tmp_path_factory) -> Path:
    import transformers

    folder = tmp_path_factory.mktemp("internvl")
    tokenizer(folder / "tokenizer.json")
    config = transformers.InternVLConfig(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=[IMAGE, IMAGE],
            patch_size=[7, 7],
            attention_bias=True,
        ),
        text_config=dict(
            model_type="qwen2",
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=2,
        ),
        image_token_id=IMAGE_ID,
        image_seq_length=TOKENS,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.InternVLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08) if "norm" not in name and "lambda" not in name else p.normal_(1.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "GotOcr2ImageProcessor",
                "size": {"height": IMAGE, "width": IMAGE},
                "crop_to_patches": True,
                "min_patches": 1,
                "max_patches": 4,
                "resample": 3,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": list(IMAGENET_MEAN),
                "image_std": list(IMAGENET_STD),
            }
        )
    )
    return folder


@pytest.fixture(scope="session")
def internvl_reference(internvl_checkpoint):
    import transformers

    return transformers.InternVLForConditionalGeneration.from_pretrained(
        internvl_checkpoint, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def internvl_ours(internvl_checkpoint):
    spec = infer_spec(json.loads((internvl_checkpoint / "config.json").read_text()))
    processing, vision = read_processing(spec, internvl_checkpoint)
    return load_multimodal(spec, internvl_checkpoint, MAX_SEQ, vision), processing


def pixel_values(frames) -> torch.Tensor:
    x = torch.from_numpy(np.stack(frames)).float() / 255
    return (x - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)


def test_internvl_loads_as_its_family_and_matches_transformers(internvl_ours, internvl_reference, internvl_checkpoint):
    from tokenizers import Tokenizer

    model, processing = internvl_ours
    assert (processing.kind, processing.tile_size, processing.max_tiles, processing.tokens_per_image) == (
        "internvl",
        IMAGE,
        4,
        TOKENS,
    )
    frame = image_frames(photo(IMAGE, IMAGE), processing).pixels[0]
    with torch.no_grad():
        expected = internvl_reference.model.get_image_features(
            pixel_values([frame]), vision_feature_layer=-1, vision_feature_select_strategy="default"
        ).pooler_output[0]
        got = model.vision(torch.from_numpy(frame).unsqueeze(0))[0]
    assert got.shape == expected.shape == (TOKENS, 64)
    assert (got - expected).abs().max() <= 1e-4

    expanded = expand_prompt(PROMPT, [image_frames(photo(IMAGE, IMAGE), processing)], processing)
    assert f"<img>{'<IMG_CONTEXT>' * TOKENS}</img>" in expanded
    ids = Tokenizer.from_file(str(internvl_checkpoint / "tokenizer.json")).encode(expanded).ids
    with torch.no_grad():
        expected = internvl_reference(input_ids=torch.tensor([ids]), pixel_values=pixel_values([frame])).logits[0, -1]
        h = model.decoder.embed(torch.tensor([ids]))
        h[0, [i for i, t in enumerate(ids) if t == IMAGE_ID]] = got
        logits = model.decoder.forward_embeddings(h, torch.tensor([0]))[0, -1]
    assert expected.abs().max() > 0.5 and (logits - expected).abs().max() <= 1e-4


@pytest.fixture(scope="session")
def internvl_program(internvl_checkpoint, tmp_path_factory) -> Path:
    return export_program(internvl_checkpoint, tmp_path_factory.mktemp("internvl-program"), MAX_SEQ)


def test_internvl_program_matches_transformers_and_executorch_multimodal_runner(
    internvl_program, internvl_reference, tmp_path, capfd
):
    frame = photo(IMAGE, IMAGE).transpose(2, 0, 1).copy()
    image = write_ppm(tmp_path / "photo.ppm", photo(IMAGE, IMAGE))
    ours = run(str(internvl_program), "--image", str(image), "--prompt", PROMPT, "--max-new-tokens", "10")
    ids = ours["prompt_tokens"]
    assert ours["image_tokens"] == TOKENS
    assert ours["tokens"] == hf_greedy(internvl_reference, ids, pixel_values([frame]), 10, eos=2)

    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    from executorch.extension.llm.runner import GenerationConfig, MultimodalRunner, make_image_input, make_token_input
    from tokenizers import Tokenizer

    first, last = ids.index(IMAGE_ID), len(ids) - ids[::-1].index(IMAGE_ID)
    inputs = [make_token_input(ids[:first]), make_image_input(torch.from_numpy(frame)), make_token_input(ids[last:])]
    capfd.readouterr()
    stats = []
    MultimodalRunner(str(internvl_program / "multimodal.pte"), str(internvl_program / "tokenizer.json")).generate(
        inputs, GenerationConfig(echo=False, max_new_tokens=10, temperature=0.0), stats_callback=stats.append
    )
    printed = capfd.readouterr().out
    tok = Tokenizer.from_file(str(internvl_program / "tokenizer.json"))
    assert stats[0].num_prompt_tokens == len(ids)
    assert printable(tok.decode(ours["tokens"], skip_special_tokens=False)) in printable(printed)


def test_internvl_prompt_takes_every_tile():
    from genai_pipeline.registry import get_spec

    p = get_spec("internvl3-1b").vision.preprocessing
    tiles = Frames(pixels=(None,) * 5, rows=2, cols=2)
    assert image_prompt(tiles, p) == "<img>" + "<IMG_CONTEXT>" * 256 * 5 + "</img>"


@pytest.mark.parametrize(
    "h,w,mode", [(37, 53, "RGB"), (90, 40, "RGB"), (56, 56, "L"), (50, 120, "RGBA"), (28, 28, "RGB")]
)
def test_internvl_frames_equal_transformers_processor_pixel_for_pixel(internvl_ours, h, w, mode):
    Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed: transformers' processor needs it")
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from genai_pipeline.image_files import to_rgb

    _, processing = internvl_ours
    image = Image.fromarray(photo(h, w, seed=w)).convert(mode)
    hf = GotOcr2ImageProcessorPil(
        size={"height": IMAGE, "width": IMAGE},
        crop_to_patches=True,
        min_patches=1,
        max_patches=4,
        image_mean=IMAGENET_MEAN,
        image_std=IMAGENET_STD,
    )
    out = hf.preprocess(image)
    expected = np.stack([np.asarray(x) for x in out["pixel_values"]])
    frames = image_frames(to_rgb(image), processing)
    got = (np.stack(frames.pixels) / 255.0 - np.array(IMAGENET_MEAN).reshape(1, 3, 1, 1)) / np.array(
        IMAGENET_STD
    ).reshape(1, 3, 1, 1)
    assert out["num_patches"][0] == len(frames.pixels)
    assert got.shape == expected.shape and np.abs(got - expected).max() <= 1e-5
