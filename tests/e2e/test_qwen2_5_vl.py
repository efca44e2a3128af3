"""Qwen2.5-VL (ViT with 2D RoPE and window attention, 2 x 2 patch merger, Qwen2 decoder with M-RoPE)
on a tiny random checkpoint saved by transformers: loader, eager parity of the tower and of the
logits with an image (M-RoPE positions) and without (plain RoPE), at each image's own grid
(square, wide, tall); one exported program whose tower takes any of them (dynamic shapes): its
logits and `genai run --image` greedy tokens against transformers, ExecuTorch's MultimodalRunner
(each image in a call of its own, its rows' M-RoPE columns in its embeddings), chat, eval --images."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_vision import SPECIALS, VOCAB, export_program, photo, printable, run, tokenizer, write_ppm

from genai_pipeline.checkpoints.multimodal import load_multimodal
from genai_pipeline.image_processing import expand_prompt, image_frames
from genai_pipeline.prepare.multimodal import read_processing
from genai_pipeline.registry import infer_spec
from genai_pipeline.registry.qwen2_5_vl import CLIP_MEAN, CLIP_STD

QWEN_SPECIALS = SPECIALS + ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|im_end|>"]
IMAGE = 112  # px: patch 14 -> 8 x 8 patches, merged 2 x 2 -> 4 x 4 = 16 tokens; windows of 56 px: 4
TOKENS = 16
SIDE = 140  # the program's largest side: max_pixels 112² lets a 2:1 image have 158 px (image_processing.py)
# (rows, cols) of a photo -> its smart_resize size -> merged grid: 4 x 4; 3 x 5 (windows cut by the
# right and bottom edges); 5 x 3
SIZES = {"square": (IMAGE, IMAGE), "wide": (90, 150), "tall": (150, 90)}
GRIDS = {"square": (4, 4), "wide": (3, 5), "tall": (5, 3)}
MAX_SEQ = 96
IMAGE_ID = QWEN_SPECIALS.index("<|image_pad|>")
EOS = QWEN_SPECIALS.index("<|im_end|>")
PROMPT = "<|im_start|>user\n<image>What is this?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="session")
def qwen_vl_checkpoint(tmp_path_factory) -> Path:
    import transformers

    folder = tmp_path_factory.mktemp("qwen2_5_vl")
    tokenizer(folder / "tokenizer.json", QWEN_SPECIALS)
    config = transformers.Qwen2_5_VLConfig(
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=48,
            num_heads=2,
            out_hidden_size=64,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            bos_token_id=1,
            eos_token_id=EOS,
        ),
        image_token_id=IMAGE_ID,
        vision_start_token_id=QWEN_SPECIALS.index("<|vision_start|>"),
        vision_end_token_id=QWEN_SPECIALS.index("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08) if "norm" not in name and "ln_q" not in name else p.normal_(1.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "min_pixels": 3136,
                "max_pixels": IMAGE * IMAGE,
                "size": {"shortest_edge": 3136, "longest_edge": IMAGE * IMAGE},
                "patch_size": 14,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "resample": 3,
                "image_mean": list(CLIP_MEAN),
                "image_std": list(CLIP_STD),
            }
        )
    )
    return folder


@pytest.fixture(scope="session")
def qwen_vl_reference(qwen_vl_checkpoint):
    import transformers

    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        qwen_vl_checkpoint, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def qwen_vl_ours(qwen_vl_checkpoint):
    spec = infer_spec(json.loads((qwen_vl_checkpoint / "config.json").read_text()))
    processing, vision = read_processing(spec, qwen_vl_checkpoint)
    return load_multimodal(spec, qwen_vl_checkpoint, MAX_SEQ, vision), processing


def frame_of(name: str, processing, seed: int = 0) -> np.ndarray:
    """A photo of SIZES[name] as our preprocessing makes it, uint8 [3, H, W]."""
    return image_frames(photo(*SIZES[name], seed), processing).pixels[0]


def hf_inputs(frame: np.ndarray) -> dict:
    """What Qwen2VLImageProcessor makes of a frame: normalised patches, each [3 channels,
    2 frames, 14, 14], in 2 x 2 merge-block order; and the grid."""
    x = torch.from_numpy(frame).float() / 255
    x = (x - torch.tensor(CLIP_MEAN).view(3, 1, 1)) / torch.tensor(CLIP_STD).view(3, 1, 1)
    rows, cols = frame.shape[1] // 14, frame.shape[2] // 14
    x = x.reshape(3, rows // 2, 2, 14, cols // 2, 2, 14).permute(1, 4, 2, 5, 0, 3, 6)  # gh, gw, mh, mw, c, ph, pw
    x = x.unsqueeze(5).expand(-1, -1, -1, -1, -1, 2, -1, -1)  # the still image as 2 frames
    return {"pixel_values": x.reshape(rows * cols, -1), "image_grid_thw": torch.tensor([[1, rows, cols]])}


def hf_logits(reference, ids: list[int], frame: np.ndarray | None) -> torch.Tensor:
    kwargs = {}
    if frame is not None:
        kwargs = {**hf_inputs(frame), "mm_token_type_ids": (torch.tensor([ids]) == IMAGE_ID).int()}
    with torch.no_grad():
        return reference(input_ids=torch.tensor([ids]), **kwargs).logits[0]


def prompt_ids(checkpoint: Path, processing, text: str = PROMPT, name: str = "square") -> list[int]:
    from tokenizers import Tokenizer

    expanded = expand_prompt(text, [image_frames(photo(*SIZES[name]), processing)], processing)
    return Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(expanded).ids


def eager_logits(model, ids: list[int], frame: np.ndarray | None, calls: int = 1) -> torch.Tensor:
    """Logits at every position, the embeddings with the columns the program's carry: in one call
    (our runtime) or, `calls=3`, the text before, the image, the text after (ExecuTorch's
    MultimodalRunner)."""
    with torch.no_grad():
        h = model.text_rows(torch.tensor([ids]))
        if frame is not None:
            h[torch.tensor([ids]) == IMAGE_ID] = model.image_rows(torch.from_numpy(frame).unsqueeze(0))[0]
        first, tokens = (ids.index(IMAGE_ID), ids.count(IMAGE_ID)) if frame is not None else (0, 0)
        cuts = [0, len(ids)] if calls == 1 else [0, first, first + tokens, len(ids)]
        return torch.cat(
            [model.decode(h[:, a:b], torch.tensor([a]), last_only=False)[0] for a, b in zip(cuts, cuts[1:])]
        )


def test_qwen_vl_loads_as_its_family_and_its_tower_matches_transformers(qwen_vl_ours, qwen_vl_reference):
    model, processing = qwen_vl_ours
    assert (processing.kind, processing.tile_size, processing.tokens_per_image) == ("qwen2_vl", SIDE, 25)
    assert model.decoder.config.mrope_section == (2, 3, 3) and model.vision.layer_windowed == (True, False)
    for name, (rows, cols) in GRIDS.items():
        frame = frame_of(name, processing)
        assert frame.shape[1:] == (28 * rows, 28 * cols), name
        with torch.no_grad():
            expected = qwen_vl_reference.model.get_image_features(**hf_inputs(frame)).pooler_output[0]
            got = model.vision(torch.from_numpy(frame).unsqueeze(0))[0]
        assert got.shape == expected.shape == (rows * cols, 64), name
        assert expected.abs().max() > 0.1 and (got - expected).abs().max() <= 1e-4, name


@pytest.mark.parametrize("name", ["square", "wide"])
def test_qwen_vl_logits_with_an_image_follow_mrope_and_without_equal_plain_rope(
    qwen_vl_ours, qwen_vl_reference, qwen_vl_checkpoint, name
):
    model, processing = qwen_vl_ours
    ids = prompt_ids(qwen_vl_checkpoint, processing, name=name)
    first, tokens = ids.index(IMAGE_ID), ids.count(IMAGE_ID)
    assert tokens == GRIDS[name][0] * GRIDS[name][1] and ids[first - 1] == QWEN_SPECIALS.index("<|vision_start|>")
    frame = frame_of(name, processing)
    expected = hf_logits(qwen_vl_reference, ids, frame)
    for calls in (1, 3):
        got = eager_logits(model, ids, frame, calls)
        assert expected.abs().max() > 0.5 and (got - expected).abs().max() <= 1e-4
    # plain RoPE at the image's tokens would be another model: M-RoPE is what makes them equal
    with torch.no_grad():
        h = model.decoder.embed(torch.tensor([ids]))
        h[0, [i for i, t in enumerate(ids) if t == IMAGE_ID]] = model.vision(torch.from_numpy(frame).unsqueeze(0))[0]
        plain = model.decoder.forward_embeddings(h, torch.tensor([0]))[0]
    assert (plain - expected).abs().max() > 1e-2

    text = ids[: first - 1] + ids[first + tokens + 1 :]  # the prompt without its image: M-RoPE is plain RoPE
    with torch.no_grad():
        plain = model.decoder(torch.tensor([text]), torch.tensor([0]))[0]
    assert (eager_logits(model, text, None) - plain).abs().max() == 0
    assert (plain - hf_logits(qwen_vl_reference, text, None)).abs().max() <= 1e-4


def hf_greedy(reference, ids: list[int], frame: np.ndarray, n: int) -> list[int]:
    ids, out = list(ids), []
    for _ in range(n):
        token = int(hf_logits(reference, ids, frame)[-1].argmax())
        if token == EOS:
            break
        out.append(token)
        ids.append(token)
    return out


@pytest.fixture(scope="session")
def qwen_vl_program(qwen_vl_checkpoint, tmp_path_factory) -> Path:
    return export_program(qwen_vl_checkpoint, tmp_path_factory.mktemp("qwen2_5_vl-program"), MAX_SEQ)


def test_qwen_vl_program_matches_transformers(qwen_vl_program, qwen_vl_reference, qwen_vl_ours, tmp_path):
    """One program, the image at its own grid: square, then wide (one session: each call's
    positions follow from the cache's), then text alone in a new conversation."""
    from genai_pipeline.runtime.multimodal import MultimodalSession
    from genai_pipeline.tokenizer import Tokenizer

    manifest = json.loads((qwen_vl_program / "manifest.json").read_text())
    assert manifest["vision"]["tokens_per_image"] == 25 and manifest["vision"]["image_size"] == SIDE
    session = MultimodalSession(qwen_vl_program)
    for name in ("square", "wide"):
        image = write_ppm(tmp_path / f"{name}.ppm", photo(*SIZES[name]))
        ids = session.encode_prompt(Tokenizer(qwen_vl_program / "tokenizer.json"), PROMPT, [image])
        assert ids.count(IMAGE_ID) == GRIDS[name][0] * GRIDS[name][1]
        session.pos = 0
        got = session.prefill(ids)
        expected = hf_logits(qwen_vl_reference, ids, frame_of(name, qwen_vl_ours[1]))[-1]
        assert (got - expected).abs().max() <= 1e-3, name
    text = ids[: ids.index(IMAGE_ID) - 1]  # a new conversation at 0, text only: the image's positions are gone
    session.pos = 0
    assert (session.prefill(text) - hf_logits(qwen_vl_reference, text, None)[-1]).abs().max() <= 1e-3

    ours = run(str(qwen_vl_program), "--image", str(image), "--prompt", PROMPT, "--max-new-tokens", "8")
    assert ours["prompt_tokens"] == ids and ours["image_tokens"] == 15
    assert ours["tokens"] == hf_greedy(qwen_vl_reference, ids, frame_of("wide", qwen_vl_ours[1]), 8)


def stock_runner_text(program: Path, inputs: list, n: int, capfd) -> str:
    """What ExecuTorch's MultimodalRunner prints, greedy (its token callback cannot take a piece
    that is not whole UTF-8)."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  kernels the program calls
    from executorch.extension.llm.runner import GenerationConfig, MultimodalRunner

    capfd.readouterr()
    MultimodalRunner(str(program / "multimodal.pte"), str(program / "tokenizer.json")).generate(
        inputs, GenerationConfig(echo=False, max_new_tokens=n, temperature=0.0)
    )
    return printable(capfd.readouterr().out.split("PyTorchObserver")[0])


def text_of(program: Path, tokens: list[int]) -> str:
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(program / "tokenizer.json"))
    return printable(tok.decode(tokens, skip_special_tokens=False))


def test_qwen_vl_program_in_executorch_multimodal_runner(qwen_vl_program, qwen_vl_checkpoint, qwen_vl_ours, capfd):
    """The stock runner feeds each image in a call of its own and passes text_decoder only embeddings
    and a start position: the image's M-RoPE columns tell its rows, the positions follow. Its
    greedy tokens are ours (which are transformers', above), with a tall image (its own grid) and
    without one."""
    from executorch.extension.llm.runner import make_image_input, make_token_input

    _, processing = qwen_vl_ours
    ids = prompt_ids(qwen_vl_checkpoint, processing, name="tall")
    first, tokens = ids.index(IMAGE_ID), ids.count(IMAGE_ID)
    frame = frame_of("tall", processing)
    assert tokens == 15 and frame.shape == (3, 140, 84)
    image = write_ppm(qwen_vl_program.parent / "runner.ppm", photo(*SIZES["tall"]))
    ours = run(str(qwen_vl_program), "--image", str(image), "--prompt", PROMPT, "--max-new-tokens", "8")
    assert ours["prompt_tokens"] == ids
    inputs = [
        make_token_input(ids[:first]),
        make_image_input(torch.from_numpy(frame)),
        make_token_input(ids[first + tokens :]),
    ]
    got = stock_runner_text(qwen_vl_program, inputs, 8, capfd)
    assert got.strip() == text_of(qwen_vl_program, ours["tokens"]).strip()

    ours = run(str(qwen_vl_program), "--prompt", PROMPT.replace("<image>", ""), "--max-new-tokens", "8")
    assert IMAGE_ID not in ours["prompt_tokens"] and len(ours["tokens"]) == 8
    got = stock_runner_text(qwen_vl_program, [make_token_input(ours["prompt_tokens"])], 8, capfd)
    assert got.strip() == text_of(qwen_vl_program, ours["tokens"]).strip()


# Qwen2-VL's chat template as the Qwen2.5-VL checkpoints carry it, the image and text parts only.
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_qwen_vl_chat_with_an_image_equals_transformers_processor_and_greedy(
    qwen_vl_program, qwen_vl_reference, tmp_path
):
    import shutil

    import transformers
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from genai_pipeline.chat_template import read_chat_template
    from genai_pipeline.options import SamplingOptions
    from genai_pipeline.runtime.chat import Chat, end_of_turn_ids
    from genai_pipeline.runtime.generate import Sampler
    from genai_pipeline.runtime.multimodal import MultimodalSession
    from genai_pipeline.tokenizer import Tokenizer

    folder = Path(shutil.copytree(qwen_vl_program, tmp_path / "export"))
    (folder / "chat_template.jinja").write_text(QWEN_VL_TEMPLATE)
    image = write_ppm(tmp_path / "photo.ppm", photo(IMAGE, IMAGE))
    session, tokenizer, template = MultimodalSession(folder), Tokenizer.from_folder(folder), read_chat_template(folder)
    stop = end_of_turn_ids(folder, tokenizer, session.manifest.eos_ids, template)
    chat = Chat(session, tokenizer, template, Sampler(SamplingOptions(temperature=0.0)), stop, 6)
    chat.attach_image(image)
    reply = chat.send("What is this?")

    # Qwen2_5_VLProcessor, spelled out (it needs torchvision for its video processor): the
    # template's text, each <|image_pad|> repeated grid_t * grid_h * grid_w / merge² times
    grid = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=IMAGE * IMAGE).preprocess(Image.open(image))
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = hf_tokenizer.apply_chat_template(
        messages, chat_template=QWEN_VL_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    text = text.replace("<|image_pad|>", "<|image_pad|>" * (int(grid["image_grid_thw"][0].prod()) // 4))
    expected = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = chat.render(chat.messages[:1], chat.images)
    assert ids == list(expected) and ids.count(IMAGE_ID) == TOKENS
    frame = photo(IMAGE, IMAGE).transpose(2, 0, 1).copy()
    assert list(reply.tokens) == hf_greedy(qwen_vl_reference, ids, frame, 6)[: len(reply.tokens)]
    assert len(reply.tokens) == 6 or reply.stop_reason == "eos"


def test_qwen_vl_eval_images_float_and_program_agree(qwen_vl_program, tmp_path, capsys):
    """`genai eval --images`: the float model (fed as the program is, each image's call alone) and
    the fp32 program give the same answers and answer perplexities."""
    from genai_pipeline.cli import main

    rows = [
        {"image": write_ppm(tmp_path / f"{i}.ppm", photo(*SIZES[name], i)).name, "prompt": p, "answer": a, "kind": "x"}
        for i, (name, p, a) in enumerate(
            [("square", "What colour is it?", "red"), ("wide", "Which shape?", "a circle")]
        )
    ]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["eval", str(qwen_vl_program), "--images", str(tmp_path / "q.jsonl"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["questions"] == 2 and result["answers_agree"] == 1.0
    float_ppl, program_ppl = result["answer_perplexity"]["float"], result["answer_perplexity"]["program"]
    assert abs(float_ppl - program_ppl) <= 1e-4 * float_ppl


def test_qwen_vl_static_recipe_is_refused_before_any_work():
    from genai_pipeline.errors import InputError
    from genai_pipeline.options import QuantOptions
    from genai_pipeline.quantize.multimodal import check_vision_language_quant

    with pytest.raises(InputError, match="M-RoPE"):
        check_vision_language_quant(QuantOptions(recipe="8a8w"), mrope=True)
    check_vision_language_quant(QuantOptions(recipe="8da4w"), mrope=True)  # dynamic recipes are not refused


def test_qwen_vl_quantized_per_component(qwen_vl_checkpoint, tmp_path_factory, capsys):
    """The default 4-bit decoder and 8-bit tower, images at their own grids (square, wide)."""
    from test_vision_quant import check_quantized_vlm, export_quantized

    folder = export_quantized(qwen_vl_checkpoint, tmp_path_factory.mktemp("qwen2_5_vl-8da4w") / "export", MAX_SEQ)
    tmp = folder.parent
    images = [write_ppm(tmp / f"{name}.ppm", photo(*SIZES[name], 3)) for name in ("square", "wide")]
    rows = [
        {"image": i.name, "prompt": "What is it?", "answer": a, "kind": "x"} for i, a in zip(images, ["red", "blue"])
    ]
    (tmp / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    check_quantized_vlm(folder, PROMPT, images, tmp / "q.jsonl", capsys)
