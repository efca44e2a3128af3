"""LLaVA-1.5 (CLIP read at its second-to-last layer, MLP connector, Llama decoder) end to end on
a tiny random checkpoint saved by transformers: loader, eager parity, one three-method program,
`genai run --image` and ExecuTorch's MultimodalRunner, CLIP preprocessing against transformers'."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_vision import SPECIALS, VOCAB, export_program, hf_greedy, photo, printable, run, tokenizer, write_ppm

from genai_pipeline.checkpoints.multimodal import load_multimodal
from genai_pipeline.image_processing import expand_prompt, image_frames
from genai_pipeline.prepare.multimodal import read_processing
from genai_pipeline.registry import infer_spec
from genai_pipeline.registry.llava import CLIP_MEAN, CLIP_STD

IMAGE = 28  # px; patch 7 -> 4 x 4 patches -> 16 tokens (the class token dropped)
TOKENS = 16
MAX_SEQ = 64
IMAGE_ID = SPECIALS.index("<image>")
PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"


@pytest.fixture(scope="session")
def llava_checkpoint(tmp_path_factory) -> Path:
    import transformers

    folder = tmp_path_factory.mktemp("llava")
    tokenizer(folder / "tokenizer.json")
    config = transformers.LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=2,
            image_size=IMAGE,
            patch_size=7,
            projection_dim=16,
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
            bos_token_id=1,
            eos_token_id=2,
        ),
        image_token_index=IMAGE_ID,
        image_seq_length=TOKENS,
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08) if "norm" not in name else p.normal_(1.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "CLIPImageProcessor",
                "do_resize": True,
                "size": {"shortest_edge": IMAGE},
                "do_center_crop": True,
                "crop_size": {"height": IMAGE, "width": IMAGE},
                "resample": 3,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": list(CLIP_MEAN),
                "image_std": list(CLIP_STD),
            }
        )
    )
    return folder


@pytest.fixture(scope="session")
def llava_reference(llava_checkpoint):
    import transformers

    return transformers.LlavaForConditionalGeneration.from_pretrained(llava_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def llava_ours(llava_checkpoint):
    spec = infer_spec(json.loads((llava_checkpoint / "config.json").read_text()))
    processing, vision = read_processing(spec, llava_checkpoint)
    return load_multimodal(spec, llava_checkpoint, MAX_SEQ, vision), processing


def pixel_values(frame: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(frame).float().unsqueeze(0) / 255
    return (x - torch.tensor(CLIP_MEAN).view(1, 3, 1, 1)) / torch.tensor(CLIP_STD).view(1, 3, 1, 1)


def test_llava_loads_as_its_family_and_matches_transformers(llava_ours, llava_reference, llava_checkpoint):
    from tokenizers import Tokenizer

    model, processing = llava_ours
    assert (processing.kind, processing.tile_size, processing.tokens_per_image) == ("clip", IMAGE, TOKENS)
    assert model.vision.config.n_layers == 2  # the third layer's output is never read
    frame = image_frames(photo(IMAGE, IMAGE), processing).pixels[0]
    with torch.no_grad():
        expected = llava_reference.model.get_image_features(pixel_values(frame)).pooler_output[0]
        got = model.vision(torch.from_numpy(frame).unsqueeze(0))[0]
    assert got.shape == expected.shape == (TOKENS, 64)
    assert (got - expected).abs().max() <= 1e-4

    expanded = expand_prompt(PROMPT, [image_frames(photo(IMAGE, IMAGE), processing)], processing)
    ids = Tokenizer.from_file(str(llava_checkpoint / "tokenizer.json")).encode(expanded).ids
    assert ids.count(IMAGE_ID) == TOKENS
    with torch.no_grad():
        expected = llava_reference(input_ids=torch.tensor([ids]), pixel_values=pixel_values(frame)).logits[0, -1]
        h = model.decoder.embed(torch.tensor([ids]))
        h[0, [i for i, t in enumerate(ids) if t == IMAGE_ID]] = got
        logits = model.decoder.forward_embeddings(h, torch.tensor([0]))[0, -1]
    assert expected.abs().max() > 0.5 and (logits - expected).abs().max() <= 1e-4


@pytest.fixture(scope="session")
def llava_program(llava_checkpoint, tmp_path_factory) -> Path:
    return export_program(llava_checkpoint, tmp_path_factory.mktemp("llava-program"), MAX_SEQ)


def test_llava_program_matches_transformers_and_executorch_multimodal_runner(
    llava_program, llava_reference, tmp_path, capfd
):
    frame = photo(IMAGE, IMAGE).transpose(2, 0, 1).copy()
    image = write_ppm(tmp_path / "photo.ppm", photo(IMAGE, IMAGE))
    ours = run(str(llava_program), "--image", str(image), "--prompt", PROMPT, "--max-new-tokens", "10")
    ids = ours["prompt_tokens"]
    assert ours["image_tokens"] == TOKENS
    assert ours["tokens"] == hf_greedy(llava_reference, ids, pixel_values(frame), 10, eos=2)

    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    from executorch.extension.llm.runner import GenerationConfig, MultimodalRunner, make_image_input, make_token_input
    from tokenizers import Tokenizer

    first, last = ids.index(IMAGE_ID), len(ids) - ids[::-1].index(IMAGE_ID)
    inputs = [make_token_input(ids[:first]), make_image_input(torch.from_numpy(frame)), make_token_input(ids[last:])]
    # No token callback: ExecuTorch's Python binding raises UnicodeDecodeError on a token that is part
    # of a UTF-8 character (docs/deployment.md); the runner's own printout, bytes as they come, is compared.
    capfd.readouterr()
    stats = []
    MultimodalRunner(str(llava_program / "multimodal.pte"), str(llava_program / "tokenizer.json")).generate(
        inputs, GenerationConfig(echo=False, max_new_tokens=10, temperature=0.0), stats_callback=stats.append
    )
    printed = capfd.readouterr().out
    tok = Tokenizer.from_file(str(llava_program / "tokenizer.json"))
    assert stats[0].num_prompt_tokens == len(ids)
    assert printable(tok.decode(ours["tokens"], skip_special_tokens=False)) in printable(printed)


@pytest.mark.parametrize("h,w,mode", [(37, 53, "RGB"), (90, 40, "RGB"), (64, 64, "L"), (50, 81, "RGBA")])
def test_clip_frames_equal_transformers_processor_pixel_for_pixel(llava_ours, h, w, mode):
    Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed: transformers' processor needs it")
    from transformers import CLIPImageProcessorPil

    from genai_pipeline.image_files import to_rgb

    _, processing = llava_ours
    image = Image.fromarray(photo(h, w, seed=w)).convert(mode)
    hf = CLIPImageProcessorPil(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE})
    expected = np.asarray(hf.preprocess(image)["pixel_values"][0])
    frame = image_frames(to_rgb(image), processing).pixels[0] / 255.0
    got = (frame - np.array(CLIP_MEAN).reshape(3, 1, 1)) / np.array(CLIP_STD).reshape(3, 1, 1)
    assert got.shape == expected.shape and np.abs(got - expected).max() <= 1e-5
