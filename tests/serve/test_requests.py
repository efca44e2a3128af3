"""serve/requests.py: OpenAI request bodies into frozen dataclasses, OpenAI's defaults, and one
RequestError (a status, a one-line message, the field) for each thing wrong."""

from __future__ import annotations

import base64

import pytest

from genai_pipeline.messages import ContentPart, Message
from genai_pipeline.serve.requests import (
    RequestError,
    ServedModel,
    parse_chat,
    parse_completion,
    parse_json,
)

TEXT = ServedModel("m", context=256, takes_images=False)
VISION = ServedModel("m", context=256, takes_images=True)
USER = [{"role": "user", "content": "Hi"}]
PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG bytes").decode()


def refused(parse, body: dict, model=TEXT, status: int = 400) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse(body, model)
    assert e.value.status == status and "\n" not in e.value.message
    assert e.value.body["error"]["message"] == e.value.message
    return e.value


def test_defaults_are_openais():
    request = parse_chat({"model": "m", "messages": USER}, TEXT)
    d = request.decoding
    assert (d.sampling.temperature, d.sampling.top_p, d.sampling.top_k) == (1.0, 1.0, 0)
    assert d.max_tokens is None and d.stop == () and not d.stream and not d.include_usage
    other = parse_chat({"model": "m", "messages": USER}, TEXT).decoding.sampling.seed
    assert d.sampling.seed != other  # no seed: a fresh one per request
    assert request.messages == (Message("user", "Hi"),) and request.images == ()


def test_fields_are_read():
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": None},
        ],
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 40,
        "seed": 3,
        "max_completion_tokens": 7,
        "stop": "\n",
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": "ignored",
    }
    request = parse_chat(body, TEXT)
    assert request.messages == (Message("system", "Be brief."), Message("user", "Hi there"), Message("assistant", ""))
    d = request.decoding
    assert (d.sampling.temperature, d.sampling.top_p, d.sampling.top_k, d.sampling.seed) == (0.0, 0.5, 40, 3)
    assert (d.max_tokens, d.stop, d.stream, d.include_usage) == (7, ("\n",), True, True)


def test_images_are_data_urls_read_in_order():
    content = [
        {"type": "image_url", "image_url": {"url": PNG}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": PNG},
    ]
    request = parse_chat({"model": "m", "messages": [{"role": "user", "content": content}]}, VISION)
    assert request.images == (b"\x89PNG bytes", b"\x89PNG bytes")
    parts = request.messages[0].content
    assert [p.type for p in parts] == ["image", "text", "image"] and parts[1] == ContentPart("text", text="and")


def test_completion_prompts():
    assert parse_completion({"model": "m", "prompt": "Hi"}, TEXT).prompt == "Hi"
    assert parse_completion({"model": "m", "prompt": ["Hi"]}, TEXT).prompt == "Hi"
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}, TEXT).prompt == (1, 2, 3)
    assert parse_completion({"model": "m", "prompt": [[1, 2]]}, TEXT).prompt == (1, 2)
    for prompt in ("", ["a", "b"], [], [1, "a"], [True], None):
        assert refused(parse_completion, {"model": "m", "prompt": prompt}).param == "prompt"


@pytest.mark.parametrize(
    "change, param, status",
    [
        ({"model": "other"}, "model", 404),
        ({"model": None}, "model", 400),
        ({"max_tokens": -1}, "max_tokens", 400),
        ({"max_tokens": 0}, "max_tokens", 400),
        ({"max_tokens": 257}, "max_tokens", 400),
        ({"max_tokens": 2.5}, "max_tokens", 400),
        ({"max_completion_tokens": True}, "max_completion_tokens", 400),
        ({"temperature": -0.1}, "temperature", 400),
        ({"temperature": 2.5}, "temperature", 400),
        ({"temperature": float("nan")}, "temperature", 400),
        ({"top_p": 0}, "top_p", 400),
        ({"top_k": -1}, "top_k", 400),
        ({"seed": "x"}, "seed", 400),
        ({"stop": ["a"] * 5}, "stop", 400),
        ({"stop": [""]}, "stop", 400),
        ({"stop": "x" * 300}, "stop", 400),
        ({"stream": "yes"}, "stream", 400),
        ({"stream_options": {"include_usage": True}}, "stream_options", 400),
        ({"n": 2}, "n", 400),
        ({"logprobs": True}, "logprobs", 400),
        ({"tools": [{"type": "function"}]}, "tools", 400),
        ({"frequency_penalty": 0.5}, "frequency_penalty", 400),
    ],
)
def test_bad_fields_are_refused(change, param, status):
    assert refused(parse_chat, {"model": "m", "messages": USER, **change}, status=status).param == param


@pytest.mark.parametrize(
    "messages, model, needle",
    [
        (None, TEXT, "non-empty list"),
        ([], TEXT, "non-empty list"),
        (["Hi"], TEXT, "must be an object"),
        ([{"role": "tool", "content": "x"}], TEXT, "role 'tool'"),
        ([{"role": "user"}], TEXT, "'content' must be"),
        ([{"role": "user", "content": [{"type": "audio"}]}], TEXT, "must be {type: text"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]}], TEXT, "text-only"),
        ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": PNG}}]}], VISION, "only user"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}],
            VISION,
            "not fetched",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}],
            VISION,
            "not fetched",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png,abc"}}]}],
            VISION,
            "base64",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:;base64,@@"}}]}],
            VISION,
            "malformed",
        ),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": 3}]}], VISION, "'image_url' must be"),
    ],
)
def test_bad_messages_are_refused(messages, model, needle):
    assert needle in refused(parse_chat, {"model": "m", "messages": messages}, model).message


def test_limits_on_messages_parts_and_images(monkeypatch):
    monkeypatch.setenv("GENAI_MAX_REQUEST_MESSAGES", "2")
    monkeypatch.setenv("GENAI_MAX_REQUEST_PARTS", "3")
    monkeypatch.setenv("GENAI_MAX_REQUEST_IMAGES", "1")
    parse_chat({"model": "m", "messages": USER * 2}, TEXT)
    assert "GENAI_MAX_REQUEST_MESSAGES" in refused(parse_chat, {"model": "m", "messages": USER * 3}).message
    parts = [{"type": "text", "text": "a"}] * 4
    assert (
        "GENAI_MAX_REQUEST_PARTS"
        in refused(parse_chat, {"model": "m", "messages": [{"role": "user", "content": parts}]}).message
    )
    images = [{"type": "image_url", "image_url": {"url": PNG}}] * 2
    message = refused(parse_chat, {"model": "m", "messages": [{"role": "user", "content": images}]}, VISION).message
    assert "2 images, over this server's limit of 1 (GENAI_MAX_REQUEST_IMAGES)" in message


@pytest.mark.parametrize(
    "body, needle",
    [(b"{", "not valid JSON"), (b"\xff\xfe", "not valid JSON"), (b"[]", "JSON object"), (b"[" * 50_000, "nested")],
)
def test_bodies_that_are_not_a_json_object(body, needle):
    with pytest.raises(RequestError, match=needle) as e:
        parse_json(body)
    assert e.value.status == 400 and e.value.code == "invalid_json"
