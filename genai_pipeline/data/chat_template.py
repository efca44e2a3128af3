"""Samples -> token ids: text is encoded as is; a chat goes through the model's chat template.

The template is rendered as Hugging Face `apply_chat_template` renders it (Jinja in a sandbox,
`trim_blocks`, `lstrip_blocks`, `raise_exception`, `strftime_now`), with `messages`,
`add_generation_prompt=False` and `bos_token` / `eos_token` when given. The rendered text already
holds the template's special tokens, so it is encoded without adding them again. Without a template,
a chat is joined as "role: content" lines and encoded like plain text. Image parts reach the
template as {"type": "image", "image": path}; the text-only fallback leaves them out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Protocol

from genai_pipeline.data.samples import Message, Sample
from genai_pipeline.errors import DataError


class TextEncoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template and the special-token strings it refers to."""

    source: str
    bos_token: str | None = None
    eos_token: str | None = None


def _token(value) -> str | None:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_chat_template(folder: Path) -> ChatTemplate | None:
    """The chat template of a local Hugging Face checkpoint (`chat_template.jinja`, else the
    `chat_template` of tokenizer_config.json, the "default" one when it lists several), or None."""
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    config = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"'{config_path}' is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        source = jinja_file.read_text(encoding="utf-8")
    if not isinstance(source, str) or not source.strip():
        return None
    return ChatTemplate(source, _token(config.get("bos_token")), _token(config.get("eos_token")))


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str):
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateSyntaxError as e:
        raise DataError(f"the chat template does not parse: {e.message} at line {e.lineno}") from None


def _as_json(message: Message) -> dict:
    if isinstance(message.content, str):
        return {"role": message.role, "content": message.content}
    parts = [
        {"type": "text", "text": p.text} if p.type == "text" else {"type": "image", "image": str(p.image)}
        for p in message.content
    ]
    return {"role": message.role, "content": parts}


def render_chat(
    messages: tuple[Message, ...], chat_template: str | None, *, bos_token: str | None = None, eos_token: str | None = None
) -> str:
    """The chat as the model sees it: the template's text, or "role: content" lines without one."""
    if chat_template is None:
        return "".join(f"{m.role}: {m.text}\n" for m in messages)
    from jinja2.exceptions import TemplateError

    variables = {"messages": [_as_json(m) for m in messages], "add_generation_prompt": False}
    variables.update({k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None})
    try:
        return _compile(chat_template).render(**variables)
    except (TemplateError, TypeError, ValueError, KeyError) as e:
        raise DataError(f"the chat template fails: {e}") from None


def render_sample(
    sample: Sample,
    tokenizer: TextEncoder,
    chat_template: str | None = None,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> list[int]:
    """A sample's token ids, ready for the collator."""
    if sample.text is not None:
        return list(tokenizer.encode(sample.text))
    try:
        text = render_chat(sample.messages, chat_template, bos_token=bos_token, eos_token=eos_token)
    except DataError as e:
        raise DataError(f"{sample.origin or 'a chat sample'}: {e}") from None
    return list(tokenizer.encode(text, add_special_tokens=chat_template is None))
