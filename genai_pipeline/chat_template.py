"""Samples -> token ids: text is encoded as is; a chat goes through the model's chat template.

The template is rendered as Hugging Face `apply_chat_template` renders it (Jinja in a sandbox,
`trim_blocks`, `lstrip_blocks`, `raise_exception`, `strftime_now`, its `tojson` and the
`{% generation %}` tag), with `messages`, `add_generation_prompt` (False for calibration, True for
a chat's next reply) and `bos_token` / `eos_token` when given. The rendered text already holds the
template's special tokens, so it is encoded without adding them again, as
`apply_chat_template(tokenize=True)` does. Without a template, a chat is joined as
"role: content" lines and encoded like plain text. Image parts reach the template as
{"type": "image", "image": path}; the text-only fallback leaves them out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from genai_pipeline.errors import ChatTemplateError, DataError

if TYPE_CHECKING:  # the chat types are data's; rendering only reads role and content
    from genai_pipeline.data.samples import Message


class TextEncoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template and the special-token strings it refers to."""

    source: str
    bos_token: str | None = None
    eos_token: str | None = None
    origin: str = field(default="", compare=False)  # the file it was read from, for messages


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"'{path}' is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None


def _token(value) -> str | None:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_chat_template(folder: Path) -> ChatTemplate | None:
    """The chat template of a local Hugging Face checkpoint (`chat_template.jinja`, else a
    processor's `chat_template` in chat_template.json or processor_config.json, else the
    `chat_template` of tokenizer_config.json, the "default" one when it lists several), or None.
    Its special tokens come from tokenizer_config.json; as in `transformers`, the legacy
    special_tokens_map.json overrides them only when tokenizer_config.json has no `added_tokens_decoder`."""
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    source, origin = config.get("chat_template"), str(config_path)
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    # A vision-language processor's template (SmolVLM's lives in processor_config.json, older
    # processors' in chat_template.json) is the one its processor applies: it places images.
    for name in ("processor_config.json", "chat_template.json"):
        processor_template = _read_json(folder / name).get("chat_template") if (folder / name).is_file() else None
        if isinstance(processor_template, str) and processor_template.strip():
            source, origin = processor_template, str(folder / name)
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        source, origin = jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    if not isinstance(source, str) or not source.strip():
        return None
    tokens = {name: _token(config.get(name)) for name in ("bos_token", "eos_token")}
    legacy_map = folder / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and legacy_map.is_file():
        overrides = {name: _token(value) for name, value in _read_json(legacy_map).items() if name in tokens}
        tokens.update({name: value for name, value in overrides.items() if value is not None})
    return ChatTemplate(source, origin=origin, **tokens)


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Hugging Face replaces Jinja's `tojson`, which escapes <, >, & and ' for HTML.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(source: str):
    from jinja2 import TemplateSyntaxError, nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks an assistant's text for Hugging Face's
        training masks; rendering shows its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e.message} at line {e.lineno}") from None


def _as_json(message: Message) -> dict:
    if isinstance(message.content, str):
        return {"role": message.role, "content": message.content}
    parts = [
        {"type": "text", "text": p.text} if p.type == "text" else {"type": "image", "image": str(p.image)}
        for p in message.content
    ]
    return {"role": message.role, "content": parts}


def render_chat(
    messages: tuple[Message, ...],
    chat_template: str | None,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    add_generation_prompt: bool = False,
) -> str:
    """The chat as the model sees it: the template's text, or "role: content" lines without one.
    `add_generation_prompt` appends what opens the assistant's next turn."""
    if chat_template is None:
        return "".join(f"{m.role}: {m.text}\n" for m in messages)
    from jinja2.exceptions import TemplateError

    variables = {"messages": [_as_json(m) for m in messages], "add_generation_prompt": add_generation_prompt}
    variables.update({k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None})
    try:
        return _compile(chat_template).render(**variables)
    except (TemplateError, TypeError, ValueError, KeyError) as e:
        raise ChatTemplateError(f"the chat template fails: {e}") from None
