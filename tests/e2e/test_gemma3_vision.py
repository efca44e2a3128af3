"""Gemma 3 with images (SigLIP, average pool, Gemma RMSNorm + projection, the Gemma 3 decoder with
each image's tokens attending both ways) end to end on a tiny random checkpoint saved by
transformers: loader, eager parity, one three-method program, `genai run --image`, ExecuTorch's
MultimodalRunner, and the prompt and pan-and-scan frames against transformers' Gemma3Processor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_vision import export_program, photo, printable, run, tokenizer, write_ppm

from genai_pipeline.checkpoints.multimodal import load_multimodal
from genai_pipeline.image_processing import expand_prompt, image_frames
from genai_pipeline.manifest import Manifest
from genai_pipeline.prepare.multimodal import read_processing
from genai_pipeline.registry import infer_spec
from genai_pipeline.registry.chat_templates import GEMMA_VISION

SPECIALS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
EOS, BOS, END_OF_TURN = 1, 2, 4
BOI, EOI, IMAGE_ID = 5, 6, 7
VOCAB = 320
IMAGE = 32  # px; patch 8 -> 4 x 4 patches, pooled by 2 -> 4 tokens per image
TOKENS = 4
MAX_SEQ = 64
NEW_TOKENS = 10
PROMPT = "<start_of_turn>user\nLook: <start_of_image> What is it?<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="session")
def gemma3_checkpoint(tmp_path_factory) -> Path:
    import transformers

    folder = tmp_path_factory.mktemp("gemma3-vision")
    tokenizer(folder / "tokenizer.json", SPECIALS, VOCAB, bos="<bos>")  # ids 0..7: Gemma's special tokens
    config = transformers.Gemma3Config(
        vision_config=dict(
            model_type="siglip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE,
            patch_size=8,
            vision_use_head=False,
        ),
        text_config=dict(
            model_type="gemma3_text",
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            intermediate_size=128,
            max_position_embeddings=256,
            sliding_window=6,  # shorter than the prompt: the window and an image's tokens meet
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
            bos_token_id=BOS,
            eos_token_id=EOS,
            pad_token_id=0,
        ),
        mm_tokens_per_image=TOKENS,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMAGE_ID,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Gemma's norms scale by 1 + w; a smaller token table (scaled by sqrt(64) on the way in) keeps
            # the tied head from answering the last prompt token again and again
            p.normal_(0, 0.05 if "embed_tokens" in name else 0.1) if "norm" not in name else p.normal_(0.0, 0.2)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS, "eos_token_id": [EOS, END_OF_TURN]})
    )
    (folder / "chat_template.jinja").write_text(GEMMA_VISION)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    # Google's layout: the image processor's settings in preprocessor_config.json (pan-and-scan null:
    # the processor's default, off), the image's token count in processor_config.json
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Gemma3ImageProcessor",
                "do_convert_rgb": None,
                "do_pan_and_scan": None,
                "pan_and_scan_max_num_crops": None,
                "pan_and_scan_min_crop_size": None,
                "pan_and_scan_min_ratio_to_activate": None,
                "do_resize": True,
                "size": {"height": IMAGE, "width": IMAGE},
                "resample": 2,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
            }
        )
    )
    (folder / "processor_config.json").write_text(
        json.dumps({"image_seq_length": TOKENS, "processor_class": "Gemma3Processor"})
    )
    return folder


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_checkpoint):
    import transformers

    return transformers.Gemma3ForConditionalGeneration.from_pretrained(gemma3_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def gemma3_ours(gemma3_checkpoint):
    spec = infer_spec(json.loads((gemma3_checkpoint / "config.json").read_text()))
    processing, vision = read_processing(spec, gemma3_checkpoint)
    return load_multimodal(spec, gemma3_checkpoint, MAX_SEQ, vision), processing


def pixel_values(frames) -> torch.Tensor:
    return (torch.from_numpy(np.stack(frames)).float() / 255 - 0.5) / 0.5


def hf_logits(reference, ids: list[int], pixels: torch.Tensor, bidirectional: bool = True) -> torch.Tensor:
    """transformers' last logits, with the token types Gemma3Processor returns (1: an image's token)."""
    types = torch.tensor([[int(t == IMAGE_ID) for t in ids]]) if bidirectional else None
    return reference(input_ids=torch.tensor([ids]), pixel_values=pixels, token_type_ids=types).logits[0, -1]


def hf_greedy(reference, ids: list[int], pixels: torch.Tensor, n: int) -> list[int]:
    ids, out = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            token = int(hf_logits(reference, ids, pixels).argmax())
            if token in (EOS, END_OF_TURN):
                break
            out.append(token)
            ids.append(token)
    return out


def prompt_ids(checkpoint: Path, processing, image: np.ndarray) -> list[int]:
    from tokenizers import Tokenizer

    expanded = expand_prompt(PROMPT, [image_frames(image, processing)], processing)
    return Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(expanded).ids


def test_gemma3_loads_as_its_family_and_matches_transformers(gemma3_ours, gemma3_reference, gemma3_checkpoint):
    model, processing = gemma3_ours
    assert (processing.kind, processing.tile_size, processing.tokens_per_image, processing.do_image_splitting) == (
        "gemma3",
        IMAGE,
        TOKENS,
        False,
    )
    assert model.vision.config.pool_kernel == 2 and model.vision.config.bidirectional_image_attention
    image = photo(IMAGE, IMAGE)
    frame = image_frames(image, processing).pixels[0]
    with torch.no_grad():
        expected = gemma3_reference.model.get_image_features(pixel_values([frame])).pooler_output[0]
        got = model.vision(torch.from_numpy(frame).unsqueeze(0))[0]
    assert got.shape == expected.shape == (TOKENS, 64)
    assert (got - expected).abs().max() <= 1e-4

    ids = prompt_ids(gemma3_checkpoint, processing, image)
    assert ids.count(IMAGE_ID) == TOKENS and ids[ids.index(IMAGE_ID) - 1] == BOI and ids[ids.index(EOI) - 1] == IMAGE_ID
    with torch.no_grad():
        h = model.decoder.embed(torch.tensor([ids]))
        image_rows = torch.tensor([[float(t == IMAGE_ID) for t in ids]])
        h[0, image_rows[0].bool()] = got
        both_ways = model.decoder.forward_embeddings(h, torch.tensor([0]), image_tokens=image_rows)[0, -1]
        causal = model.decoder.forward_embeddings(h, torch.tensor([0]))[0, -1]
        expected = hf_logits(gemma3_reference, ids, pixel_values([frame]))
        expected_causal = hf_logits(gemma3_reference, ids, pixel_values([frame]), bidirectional=False)
    assert (expected - expected_causal).abs().max() > 1e-2  # the image's two-way attention shows in the logits
    assert expected.abs().max() > 0.5 and (both_ways - expected).abs().max() <= 1e-4
    assert (causal - expected_causal).abs().max() <= 1e-4


@pytest.fixture(scope="session")
def gemma3_program(gemma3_checkpoint, tmp_path_factory) -> Path:
    return export_program(gemma3_checkpoint, tmp_path_factory.mktemp("gemma3-program"), MAX_SEQ)


def test_gemma3_program_matches_transformers_and_executorch_multimodal_runner(
    gemma3_program, gemma3_reference, gemma3_ours, tmp_path, capfd
):
    from genai_pipeline.runtime.multimodal import EagerMultimodalSession, MultimodalSession

    image = photo(IMAGE, IMAGE)
    frame = image.transpose(2, 0, 1).copy()
    ours = run(
        str(gemma3_program),
        "--image",
        str(write_ppm(tmp_path / "photo.ppm", image)),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        str(NEW_TOKENS),
    )
    ids = ours["prompt_tokens"]
    assert ours["image_tokens"] == TOKENS
    expected_tokens = hf_greedy(gemma3_reference, ids, pixel_values([frame]), NEW_TOKENS)
    assert len(set(expected_tokens)) > 1 and ours["tokens"] == expected_tokens

    # the program's image features, its image-flag column, and its prefill logits (image rows flagged
    # by its own methods) against transformers'
    from executorch.runtime import Runtime

    methods = Runtime.get().load_program(str(gemma3_program / "multimodal.pte"))
    features = methods.load_method("vision_encoder").execute([torch.from_numpy(frame).unsqueeze(0)])[0]
    text = methods.load_method("token_embedding").execute([torch.tensor([ids[:3]])])[0]
    with torch.no_grad():
        expected = gemma3_reference.model.get_image_features(pixel_values([frame])).pooler_output
    assert features.shape == (1, TOKENS, 65) and (features[..., :-1] - expected).abs().max() <= 1e-3
    assert (features[..., -1] == 1).all() and (text[..., -1] == 0).all()
    program, eager = MultimodalSession(gemma3_program), EagerMultimodalSession(gemma3_ours[0], IMAGE_ID)
    with torch.no_grad():
        expected = hf_logits(gemma3_reference, ids, pixel_values([frame]))
    for session, tolerance in ((eager, 1e-4), (program, 1e-3)):
        session.frames = [frame]
        assert (session.prefill(ids) - expected).abs().max() <= tolerance

    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    from executorch.extension.llm.runner import GenerationConfig, MultimodalRunner, make_image_input, make_token_input
    from tokenizers import Tokenizer

    first, last = ids.index(IMAGE_ID), len(ids) - ids[::-1].index(IMAGE_ID)
    inputs = [make_token_input(ids[:first]), make_image_input(torch.from_numpy(frame)), make_token_input(ids[last:])]
    capfd.readouterr()
    stats = []
    MultimodalRunner(str(gemma3_program / "multimodal.pte"), str(gemma3_program / "tokenizer.json")).generate(
        inputs,
        GenerationConfig(echo=False, max_new_tokens=len(ours["tokens"]), temperature=0.0),
        stats_callback=stats.append,
    )
    printed = capfd.readouterr().out
    tok = Tokenizer.from_file(str(gemma3_program / "tokenizer.json"))
    assert stats[0].num_prompt_tokens == len(ids)
    assert printable(tok.decode(ours["tokens"], skip_special_tokens=False)) in printable(printed)


@pytest.mark.parametrize("h,w,frames", [(32, 90, 4), (100, 30, 4), (40, 44, 1), (30, 70, 3)])
def test_gemma3_prompt_and_pan_and_scan_equal_transformers_processor(gemma3_ours, gemma3_checkpoint, h, w, frames):
    """Gemma3Processor with pan-and-scan on (crops of at least 12 px): the same ids and the same frames."""
    import dataclasses

    import transformers
    from PIL import Image
    from tokenizers import Tokenizer
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    _, processing = gemma3_ours
    processing = dataclasses.replace(processing, do_image_splitting=True, min_crop_size=12, max_tiles=3)
    image = photo(h, w, seed=w)
    hf = transformers.Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": IMAGE, "width": IMAGE}, resample=2),
        tokenizer=transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(gemma3_checkpoint / "tokenizer.json"),
            extra_special_tokens={
                "boi_token": "<start_of_image>",
                "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>",
            },
        ),
        image_seq_length=TOKENS,
    )
    out = hf(
        text=PROMPT,
        images=[Image.fromarray(image)],
        do_pan_and_scan=True,
        pan_and_scan_min_crop_size=12,
        pan_and_scan_max_num_crops=3,
        pan_and_scan_min_ratio_to_activate=1.2,
    )
    ours = image_frames(image, processing)
    ids = Tokenizer.from_file(str(gemma3_checkpoint / "tokenizer.json")).encode(
        expand_prompt(PROMPT, [ours], processing)
    )
    assert ids.ids == list(out["input_ids"][0])
    assert len(ours.pixels) == len(out["pixel_values"]) == frames  # the whole image, then its crops
    got = (np.stack(ours.pixels) / 255.0 - 0.5) / 0.5
    assert np.abs(got - np.asarray(out["pixel_values"])).max() <= 1e-5


def test_gemma3_chat_with_an_image_is_what_transformers_processor_makes_of_it(gemma3_ours, gemma3_checkpoint, tmp_path):
    """`genai run --chat` / serve's ids for a conversation with an image (the checkpoint's chat template,
    its image part expanded) against Gemma3Processor.apply_chat_template with the same template."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from genai_pipeline.chat_template import read_chat_template
    from genai_pipeline.messages import ContentPart, Message
    from genai_pipeline.runtime.chat import conversation_ids
    from genai_pipeline.tokenizer import Tokenizer

    _, processing = gemma3_ours
    image = photo(40, 90, seed=3)
    path = write_ppm(tmp_path / "wide.ppm", image)
    template = read_chat_template(gemma3_checkpoint)
    assert template.source == GEMMA_VISION and template.bos_token == "<bos>"
    ours = conversation_ids(
        Tokenizer.from_folder(gemma3_checkpoint, bos_id=BOS),
        template,
        (
            Message("system", "Be brief."),
            Message("user", (ContentPart("image", image=path), ContentPart("text", " What? "))),
        ),
        (image_frames(image, processing),),
        processing,
    )
    hf = transformers.Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": IMAGE, "width": IMAGE}, resample=2),
        tokenizer=transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(gemma3_checkpoint / "tokenizer.json"),
            bos_token="<bos>",
            extra_special_tokens={
                "boi_token": "<start_of_image>",
                "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>",
            },
        ),
        image_seq_length=TOKENS,
        chat_template=template.source,
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image", "path": str(path)}, {"type": "text", "text": " What? "}]},
    ]
    expected = hf.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)
    assert ours.count(IMAGE_ID) == TOKENS and ours == list(expected["input_ids"][0])


def test_what_would_cut_an_images_tokens_apart_is_refused_in_one_line(gemma3_checkpoint, tmp_path):
    import genai_pipeline
    from genai_pipeline.errors import InputError
    from genai_pipeline.names import Mode
    from genai_pipeline.options import PrepareOptions, QuantOptions
    from genai_pipeline.quantize.multimodal import check_vision_language_quant

    options = PrepareOptions(checkpoint=gemma3_checkpoint, split=True, mode=Mode.HYBRID, max_seq_len=MAX_SEQ)
    with pytest.raises(InputError, match="chunked prefill"):
        genai_pipeline.export(out=tmp_path / "split", prepare=options)
    with pytest.raises(InputError, match="both ways"):
        check_vision_language_quant(QuantOptions(recipe="8a8w"), image_attention_both_ways=True)


# google/gemma-3-4b-it's config.json as published: only what differs from transformers' defaults
GEMMA3_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


def test_gemma3_4b_entry_reads_its_config_as_transformers_does():
    import transformers

    from genai_pipeline.registry import get_spec

    spec = get_spec("gemma3-4b")
    assert infer_spec(GEMMA3_4B_CONFIG) is spec
    assert spec.vision.config_from_checkpoint(GEMMA3_4B_CONFIG) == spec.vision.config
    assert spec.vision.config.tokens_per_image == spec.vision.preprocessing.tokens_per_image == 256
    hf = transformers.Gemma3Config(**{k: v for k, v in GEMMA3_4B_CONFIG.items() if k != "architectures"})
    text = hf.text_config
    assert [i for i, kind in enumerate(text.layer_types) if kind == "sliding_attention"] == list(
        spec.config.sliding_window_layers
    )
    assert (text.vocab_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (
        spec.config.vocab_size,
        spec.config.n_heads,
        spec.config.n_kv_heads,
        spec.config.head_dim,
    )
    assert 4.29e9 < spec.config.num_params + spec.vision.config.num_params < 4.31e9  # "4B": 4.30 B parameters


def test_gemma3_quantized_per_component(gemma3_checkpoint, tmp_path_factory, capsys):
    """The default 4-bit decoder and 8-bit tower, the image rows still attending both ways; the tied
    table's first rows at 8 bits as a real Gemma 3's are by default (this one's table is too small to
    take any by default), its linears' inputs rotated at run time."""
    from test_vision_quant import check_quantized_vlm, export_quantized

    out = tmp_path_factory.mktemp("gemma3-8da4w") / "export"
    folder = export_quantized(gemma3_checkpoint, out, MAX_SEQ, "--table-8bit-rows", "64")
    quantization = Manifest.read(folder).quantization
    assert quantization["table_8bit_rows"] == 64 and quantization["rotate"]
    tmp = folder.parent
    images = [write_ppm(tmp / f"{seed}.ppm", photo(IMAGE, IMAGE, seed)) for seed in (3, 4)]
    rows = [
        {"image": i.name, "prompt": "What is it?", "answer": a, "kind": "x"} for i, a in zip(images, ["red", "blue"])
    ]
    (tmp / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    check_quantized_vlm(folder, PROMPT, images, tmp / "q.jsonl", capsys)
