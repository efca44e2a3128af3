"""OpenAI requests -> frozen dataclasses, every field checked; anything wrong is a RequestError
whose body is OpenAI's error object ({"error": {"message", "type", "param", "code"}}).

Chat message content may be a string or a list of parts: `text`, and on a vision-language model
`image_url` with a `data:` URL (base64). Nothing is fetched from the network: an http(s) URL is
refused. Fields that change what is generated and that this server does not implement (`n` > 1,
penalties, logprobs, tools, ...) are refused rather than ignored; the rest (`user`, `store`, ...)
are ignored.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from genai_pipeline.limits import REQUEST_IMAGES, REQUEST_MESSAGES, REQUEST_PARTS, Limit
from genai_pipeline.messages import ContentPart, Message
from genai_pipeline.options import SamplingOptions

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP = 4  # stop strings, as OpenAI's API allows
MAX_STOP_CHARS = 256
# A field whose value, when given and different from this, asks for what is not implemented here.
UNSUPPORTED = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "logprobs": None,
    "top_logprobs": None,
    "logit_bias": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "tools": None,
    "functions": None,
    "tool_choice": None,
    "function_call": None,
    "response_format": None,
}


class RequestError(Exception):
    """A request this server refuses: an HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
        error_type = "server_error" if self.status >= 500 else kind.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ServedModel:
    """What checking a request needs to know of the model served."""

    id: str
    context: int  # the program's max_seq_len
    takes_images: bool


@dataclass(frozen=True)
class Decoding:
    sampling: SamplingOptions
    max_tokens: int | None  # None: until an end of turn or the context's end
    stop: tuple[str, ...]  # the text ends before the first of these that appears
    stream: bool
    include_usage: bool  # streaming: a last chunk with the token counts


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[Message, ...]
    images: tuple[bytes, ...]  # the image_url parts' file contents, in order
    decoding: Decoding


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | tuple[int, ...]  # text, or token ids
    decoding: Decoding


def parse_json(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise RequestError(400, "the request body's JSON is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise RequestError(400, "the request body must be a JSON object", code="invalid_json")
    return data


def parse_chat(data: dict, model: ServedModel) -> ChatRequest:
    decoding = _decoding(data, model)
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError(400, "'messages' must be a non-empty list of {role, content} objects", "messages")
    _within(REQUEST_MESSAGES, len(raw), "messages")
    parts = [p for m in raw if isinstance(m, dict) and isinstance(m.get("content"), list) for p in m["content"]]
    _within(REQUEST_PARTS, len(parts), "messages")
    _within(REQUEST_IMAGES, sum(isinstance(p, dict) and p.get("type") == "image_url" for p in parts), "messages")
    messages, images = [], []
    for i, message in enumerate(raw):
        content, found = _message(message, f"messages[{i}]", model, len(images))
        messages.append(content)
        images.extend(found)
    return ChatRequest(tuple(messages), tuple(images), decoding)


def parse_completion(data: dict, model: ServedModel) -> CompletionRequest:
    decoding = _decoding(data, model)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = tuple(prompt)
    elif not isinstance(prompt, str) or not prompt:
        raise RequestError(
            400, "'prompt' must be one non-empty string or one list of token ids (one prompt per request)", "prompt"
        )
    return CompletionRequest(prompt, decoding)


def check_model(data: dict, model: ServedModel) -> None:
    name = data.get("model")
    if not isinstance(name, str):
        raise RequestError(400, "'model' is required: a string (GET /v1/models lists it)", "model")
    if name != model.id:
        raise RequestError(
            404, f"the model '{name:.100}' does not exist: this server serves '{model.id}'", "model", "model_not_found"
        )


def _within(limit: Limit, n: int, param: str) -> None:
    if n > limit.value():
        raise RequestError(
            400,
            f"the request has {n} {limit.unit}, over this server's limit of {limit.value()} ({limit.variable})",
            param,
        )


def _decoding(data: dict, model: ServedModel) -> Decoding:
    check_model(data, model)
    for name, default in UNSUPPORTED.items():
        if data.get(name, default) not in (default, None):
            raise RequestError(400, f"'{name}' is not supported by this server", name, "unsupported_parameter")
    stream = _typed(data, "stream", bool, False)
    options = data.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise RequestError(400, "'stream_options' is an object, and goes with 'stream': true", "stream_options")
    temperature = _number(data, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(data, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise RequestError(400, "'top_p' must be in (0, 1]", "top_p")
    top_k = _typed(data, "top_k", int, 0)
    if top_k < 0:
        raise RequestError(400, f"'top_k' must be >= 0 (0: off), got {top_k}", "top_k")
    seed = _typed(data, "seed", int, None)
    sampling = SamplingOptions(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        # No seed: a fresh one, so that repeated requests differ, as OpenAI's do.
        seed=random.SystemRandom().getrandbits(63) if seed is None else seed % (1 << 63),
    )
    param = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _typed(data, param, int, None)
    if max_tokens is not None and not 1 <= max_tokens <= model.context:
        raise RequestError(
            400, f"'{param}' must be from 1 to the model's context of {model.context}, got {max_tokens}", param
        )
    stop = data.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(400, f"'stop' must be a string or a list of up to {MAX_STOP} non-empty strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise RequestError(400, f"a 'stop' string is longer than {MAX_STOP_CHARS} characters", "stop")
    include_usage = _typed(options or {}, "include_usage", bool, False)
    return Decoding(sampling, max_tokens, tuple(stop), stream, include_usage)


def _typed(data: dict, name: str, kind: type, default):
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RequestError(400, f"'{name}' must be {'an integer' if kind is int else 'a boolean'}", name)
    return value


def _number(data: dict, name: str, default: float, low: float, high: float) -> float:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(400, f"'{name}' must be a number", name)
    if not low <= value <= high:
        raise RequestError(400, f"'{name}' must be from {low:g} to {high:g}, got {value}", name)
    return float(value)


def _message(raw, where: str, model: ServedModel, images_before: int) -> tuple[Message, list[bytes]]:
    """One message; its image parts' file contents. A message without images has its text parts
    joined into one string, the content every chat template reads."""
    if not isinstance(raw, dict) or not isinstance(raw.get("role"), str):
        raise RequestError(400, f"{where} must be an object with a 'role' and a 'content'", where)
    role = ROLES.get(raw["role"])
    if role is None:
        raise RequestError(
            400, f"{where}: role '{raw['role']:.40}' is not supported (system, developer, user, assistant)", where
        )
    content = raw.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, str):
        return Message(role, content), []
    if not isinstance(content, list):
        raise RequestError(400, f"{where}: 'content' must be a string or a list of content parts", where)
    parts, images = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(ContentPart("text", text=part["text"]))
        elif kind == "image_url":
            if role != "user":
                raise RequestError(400, f"{where}: only user messages may hold images", where)
            if not model.takes_images:
                raise RequestError(400, f"the model '{model.id}' is text-only: it cannot take images", where)
            images.append(_data_url(part.get("image_url"), f"{where}.content[{j}]"))
            # The template only needs to know where an image goes; its pixels come from `images`.
            parts.append(ContentPart("image", image=Path(f"image {images_before + len(images)}")))
        else:
            raise RequestError(
                400, f"{where}.content[{j}] must be {{type: text, text}} or {{type: image_url, image_url}}", where
            )
    if not images:
        return Message(role, "".join(p.text for p in parts)), []
    return Message(role, tuple(parts)), images


def _data_url(image_url, where: str) -> bytes:
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise RequestError(400, f"{where}: 'image_url' must be {{url: 'data:image/...;base64,...'}}", where)
    if not url.startswith("data:"):
        raise RequestError(
            400,
            f"{where}: '{url:.60}' is not fetched: this server reads images from data: URLs only (base64)",
            where,
            "image_url_not_data",
        )
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise RequestError(400, f"{where}: a data: URL of an image must be base64 ('data:image/png;base64,...')", where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, f"{where}: the data: URL's base64 is malformed", where) from None
