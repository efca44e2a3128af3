"""`genai run --chat` with images, on the tiny SmolVLM (tests/e2e/test_vision.py) in both layouts,
with SmolVLM's own chat template where SmolVLM keeps it (processor_config.json): an image is
encoded once and its tokens stay in the KV cache; a later turn's reply equals a single-shot run of
the same whole prompt; the prompt equals transformers' processor's; bad input gets one line."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
from test_vision import IMAGE, SPECIALS, checkpoint, image_file, program  # noqa: F401  session fixtures (built once: test_vision.once)
from test_vision_split import split_program  # noqa: F401

from genai_pipeline.chat_template import read_chat_template
from genai_pipeline.cli import main
from genai_pipeline.errors import InputError
from genai_pipeline.image_processing import Frames, ImageProcessing, expand_rendered_chat
from genai_pipeline.options import SamplingOptions
from genai_pipeline.runtime.chat import Chat, end_of_turn_ids, keep_cached
from genai_pipeline.runtime.generate import Sampler, generate
from genai_pipeline.runtime.multimodal import MultimodalSession
from genai_pipeline.tokenizer import Tokenizer

# HuggingFaceTB/SmolVLM-*-Instruct's processor_config.json `chat_template`, verbatim.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]['type'] == 'image' %}"
    "{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
NEW = 6
GREEDY = SamplingOptions(temperature=0.0)


def with_smolvlm_template(folder: Path, dest: Path) -> Path:
    folder = Path(shutil.copytree(folder, dest))
    processor = json.loads((folder / "processor_config.json").read_text())
    (folder / "processor_config.json").write_text(json.dumps({**processor, "chat_template": SMOLVLM_TEMPLATE}))
    return folder


@pytest.fixture(scope="module", params=["one program", "split hybrid"])
def chat_folder(request, program, split_program, tmp_path_factory) -> Path:
    source = program if request.param == "one program" else split_program("hybrid")
    return with_smolvlm_template(source, tmp_path_factory.mktemp("chat") / "export")


def _chat(folder: Path) -> Chat:
    session = MultimodalSession(folder)
    tokenizer = Tokenizer.from_folder(folder)
    template = read_chat_template(folder)
    assert template.origin.endswith("processor_config.json")
    stop = end_of_turn_ids(folder, tokenizer, session.manifest["eos_ids"], template)
    return Chat(session, tokenizer, template, Sampler(GREEDY), stop, NEW)


def test_an_image_is_encoded_once_and_a_later_reply_equals_a_single_shot_run(chat_folder, image_file):
    chat = _chat(chat_folder)
    chat.attach_image(image_file)
    first = chat.send("What is in the picture?")
    second = chat.send("Tell me more.")
    assert chat.session.vision_calls == 1  # the second turn kept the image's tokens in the cache
    ids = chat.render(chat.messages[:-1], chat.images)  # the whole prompt of the second turn
    image_slots = [i for i, t in enumerate(ids) if t == SPECIALS.index("<image>")]
    assert len(image_slots) == 4 and second.reused > image_slots[-1]

    fresh = MultimodalSession(chat_folder)
    fresh.frames = [frame for image in chat.images for frame in image.pixels]
    single_shot = generate(fresh, ids, NEW, Sampler(GREEDY), chat.stop_ids)
    assert fresh.vision_calls == 1
    assert len(second.tokens) > 0 and single_shot.tokens == list(second.tokens)
    assert len(first.tokens) > 0


def test_an_image_run_the_cache_holds_only_in_part_is_fed_whole(chat_folder, image_file):
    chat = _chat(chat_folder)
    chat.attach_image(image_file)
    images = tuple(f for _, f in chat.attached)
    ids = chat.render((chat._message("user", "Hi", (image_file,)),), images)
    slots = [i for i, t in enumerate(ids) if t == SPECIALS.index("<image>")]
    session = chat.session
    session.frames = [frame for image in images for frame in image.pixels]
    session.prefill(ids)  # the cache holds all of ids
    assert keep_cached(session, ids[: slots[-1] + 1], ids, images) == slots[-1] + 1 and session.frames == []
    assert keep_cached(session, ids[: slots[2]], ids, images) == slots[0] and len(session.frames) == 1
    assert session.pos == slots[0]
    assert keep_cached(session, ids[: slots[0]], ids, images) == slots[0] and len(session.frames) == 1


def test_chat_prompt_equals_transformers_processor(chat_folder, image_file):
    """The second turn's ids as transformers' Idefics3Processor makes them from the same messages."""
    Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed: transformers' processor needs it")
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    chat = _chat(chat_folder)
    chat.attach_image(image_file)
    reply = chat.send("What is in the picture?")
    processor = transformers.Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(
            size={"longest_edge": IMAGE}, max_image_size={"longest_edge": IMAGE}, do_image_splitting=True
        ),
        tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_file=str(chat_folder / "tokenizer.json")),
        image_seq_len=4,
        chat_template=SMOLVLM_TEMPLATE,
    )
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": reply.text}]},
        {"role": "user", "content": [{"type": "text", "text": "Tell me more."}]},
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    expected = processor(text=text, images=[Image.open(image_file)], add_special_tokens=False)["input_ids"][0]
    ours = chat.render((*chat.messages, chat._message("user", "Tell me more.")), chat.images)
    assert ours == list(expected)


def _repl(capsys, monkeypatch, folder: Path, lines: list[str], *options: str) -> tuple[int, str, list[str]]:
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
    code = main(["run", str(folder), "--chat", "--max-new-tokens", str(NEW), "--temperature", "0", *options])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


def test_repl_image_command_bad_path_and_text_only_model(
    chat_folder, image_file, export_tiny, capsys, monkeypatch, tmp_path
):
    missing = tmp_path / "nope.png"
    code, out, err = _repl(
        capsys,
        monkeypatch,
        chat_folder,
        [f"/image {missing}", f"/image {image_file}", "What is in the picture?", "Tell me more.", "/exit"],
    )
    assert code == 0
    assert [line for line in err if "nope.png" in line] == [f"genai: image '{missing}' does not exist"]
    assert f"genai: {image_file} goes with your next message" in err
    chat = _chat(chat_folder)  # the same conversation through the API: the REPL printed its replies
    chat.attach_image(image_file)
    replies = [chat.send(t).text for t in ("What is in the picture?", "Tell me more.")]
    assert out == "".join(f"{r}\n" for r in replies)

    # --image with --chat: the first message's
    code, out, _ = _repl(
        capsys,
        monkeypatch,
        chat_folder,
        ["Tell me more."],
        "--image",
        str(image_file),
        "--prompt",
        "What is in the picture?",
    )
    assert code == 0 and out == "".join(f"{r}\n" for r in replies)

    code, out, err = _repl(capsys, monkeypatch, export_tiny("hybrid"), [f"/image {image_file}", "Hi", "/exit"])
    assert code == 0 and err.count("genai: this is a text-only model: it cannot take images") == 1
    assert out.count("\n") == 1  # "Hi" was answered


def test_rendered_chat_marks_expand_as_each_processor_does():
    one = Frames(pixels=(None,), rows=0, cols=0)
    smolvlm = ImageProcessing(tile_size=IMAGE, longest_edge=IMAGE, tokens_per_image=2)
    assert expand_rendered_chat("User:<image>Hi", [one], smolvlm) == (
        "User:<fake_token_around_image><global-img><image><image><fake_token_around_image>Hi"
    )
    # InternVL's template writes the image token itself; its processor expands it per frame
    internvl = ImageProcessing(
        kind="internvl",
        tile_size=IMAGE,
        longest_edge=0,
        tokens_per_image=2,
        image_token="<IMG_CONTEXT>",
        image_start="<img>",
        image_end="</img>",
    )
    assert (
        expand_rendered_chat("user\n<IMG_CONTEXT>\nHi", [one], internvl)
        == "user\n<img><IMG_CONTEXT><IMG_CONTEXT></img>\nHi"
    )
    with pytest.raises(InputError, match="wrote 0 <IMG_CONTEXT> for 1 image"):
        expand_rendered_chat("a template that drops images", [one], internvl)
