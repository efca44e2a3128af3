"""`genai serve` on the shipped reference-vlm, through the official `openai` client: image questions
as OpenAI `image_url` parts with data: URLs answer as `genai run --image` does (the export's chat
template renders the model's own prompt), one image after another in one session (a cached prefix
is kept only as far as the images are the same), a second question on the same image reuses its
cache, and every bad image or image request gets a 4xx while the server goes on."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import openai
import pytest
from conftest import REPO
from live import LiveServer
from PIL import Image

from genai_pipeline.bundle import folder_tokenizer, read_manifest
from genai_pipeline.runtime.generate import generate, greedy_token
from genai_pipeline.runtime.open import open_session

MODEL = "reference-vlm"
HELD_OUT = REPO / "assets" / "reference-vlm"
QUESTIONS = [json.loads(line) for line in (HELD_OUT / "heldout.jsonl").read_text().splitlines()[:6]]
PIXEL_LIMIT = 100_000
IMAGE_LIMIT = 2


@pytest.fixture(scope="module")
def server(export_reference_vlm):
    env = {"GENAI_MAX_IMAGE_PIXELS": str(PIXEL_LIMIT), "GENAI_MAX_REQUEST_IMAGES": str(IMAGE_LIMIT)}
    live = LiveServer(export_reference_vlm, env=env)
    yield live
    assert live.stop() == 0, live.log


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 200, np.uint8)).save(out, format="PNG")
    return out.getvalue()


def question(url: str, text: str) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}
    ]


def ask(client, messages, max_tokens: int = 8):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens)


def test_image_questions_answer_as_genai_run_does(client, export_reference_vlm):
    """One image after another on one session: each answer is the runtime's for the raw prompt
    that `genai run --image IMG --prompt QUESTION` feeds, and the first is the held-out answer."""
    session = open_session(export_reference_vlm)
    tokenizer = tokenizer_of(export_reference_vlm)
    for q in QUESTIONS:
        image = HELD_OUT / q["image"]
        reply = ask(client, question(data_url(image.read_bytes()), q["prompt"]))
        session.reset()
        ids = session.encode_prompt(tokenizer, q["prompt"], [image])
        expected = generate(session, ids, 8, greedy_token, tuple(session.manifest["eos_ids"]))
        assert reply.choices[0].message.content == tokenizer.decode(expected.tokens), q
        assert reply.usage.prompt_tokens == len(ids) and reply.choices[0].finish_reason == "stop"
    first = ask(client, question(data_url((HELD_OUT / QUESTIONS[0]["image"]).read_bytes()), QUESTIONS[0]["prompt"]))
    assert first.choices[0].message.content.strip() == QUESTIONS[0]["answer"] == "orange"


def tokenizer_of(folder):
    return folder_tokenizer(folder, read_manifest(folder))


def test_a_second_question_on_the_same_image_reuses_its_cache(client, export_reference_vlm):
    q = QUESTIONS[0]
    messages = question(data_url((HELD_OUT / q["image"]).read_bytes()), q["prompt"])
    first = ask(client, messages)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "What shape is orange?"},
    ]
    second = ask(client, messages)
    # The image, the question and the answer are kept: only the new question is prefilled. (What
    # the model answers is its own: it was trained on questions that each follow the image.)
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    new_question = tokenizer_of(export_reference_vlm).encode("What shape is orange?", add_special_tokens=False)
    assert second.usage.prompt_tokens - second.usage.prompt_tokens_details.cached_tokens == 1 + len(new_question)  # EOS


def test_bad_images_are_refused_and_the_server_goes_on(client):
    def refused(messages, needle: str) -> str:
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, messages)
        message = e.value.body["message"]
        assert needle in message and "\n" not in message, message
        return message

    text = "What colour is the diamond?"
    refused(question("http://example.com/cat.png", text), "is not fetched: this server reads images from data: URLs")
    refused(question("https://example.com/cat.png", text), "data: URLs only")
    refused(question("data:image/png;base64,###", text), "base64 is malformed")
    refused(question("data:image/png,rawbytes", text), "must be base64")
    refused(question(data_url(b"not an image at all"), text), "is not an image file Pillow can read")
    photo = (HELD_OUT / QUESTIONS[0]["image"]).read_bytes()
    refused(question(data_url(photo[: len(photo) // 2]), text), "cannot decode image 'image 1'")
    refused(question(data_url(png(400, 400)), text), f"over the limit of {PIXEL_LIMIT:,}")
    url = data_url((HELD_OUT / QUESTIONS[0]["image"]).read_bytes())
    three = [{"type": "image_url", "image_url": {"url": url}}] * (IMAGE_LIMIT + 1)
    refused([{"role": "user", "content": three}], f"3 images, over this server's limit of {IMAGE_LIMIT}")
    image_reply = [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    refused(image_reply, "only user messages may hold images")
    refused([{"role": "user", "content": "<image> What colour is it?"}], "images go in image_url parts")
    with pytest.raises(openai.BadRequestError, match="image tokens"):
        client.completions.create(model=MODEL, prompt="<image> What colour is it?")
    assert ask(client, question(url, text)).choices[0].message.content.strip() == "orange"


def test_a_text_prompt_completes_on_the_vision_language_model(client, export_reference_vlm):
    prompt = "What colour is the diamond?"
    reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=4)
    assert reply.usage.prompt_tokens == len(tokenizer_of(export_reference_vlm).encode(prompt))
    assert reply.choices[0].finish_reason in ("stop", "length")
