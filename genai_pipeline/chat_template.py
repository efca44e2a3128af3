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

import functools
import json
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from genai_pipeline.errors import ChatTemplateError, DataError

if TYPE_CHECKING:  # the chat types are data's; rendering only reads role and content
    from genai_pipeline.messages import Message


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


# A template is code from a downloaded file, rendered at every chat turn (and every server
# request): each render is bounded. Real templates take well under a millisecond and a few
# thousand steps; these limits are three orders of magnitude above that.
RENDER_SECONDS = 2.0
RENDER_STEPS = 2_000_000  # lines of the compiled template executed
RENDER_CHARS = 1 << 24  # the longest string or list a render may build, its output included


def _too_large(what: str) -> ChatTemplateError:
    return ChatTemplateError(
        f"the chat template builds {what} of more than {RENDER_CHARS:,} characters or items; "
        "the template is broken or hostile"
    )


def _checked_size(value):
    if isinstance(value, (str, list, tuple)) and len(value) > RENDER_CHARS:
        raise _too_large("a value")
    return value


def _bounded_join(join):
    """Jinja's `~` and output joins, refusing a string past the limit before it is made."""

    def bounded(seq):
        seq = list(seq)
        if sum(len(x) if isinstance(x, str) else 16 for x in seq) > RENDER_CHARS:
            raise _too_large("a string")
        return join(seq)

    return bounded


def _render_bounded(template, variables: dict) -> str:
    """`template.render(**variables)` under the time, step, size and recursion limits above."""
    deadline, steps, size = time.monotonic() + RENDER_SECONDS, 0, 0

    def line_budget(frame, event, arg):
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > RENDER_STEPS or (steps % 1024 == 0 and time.monotonic() > deadline):
                raise ChatTemplateError(
                    f"the chat template did not finish within {RENDER_STEPS:,} steps or "
                    f"{RENDER_SECONDS:g} s; the template is broken or hostile"
                )
        return line_budget

    def only_templates(frame, event, arg):  # Python's own code runs untraced, at full speed
        return line_budget if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(only_templates)
    try:
        pieces = []
        for piece in template.generate(**variables):
            size += len(piece)
            if size > RENDER_CHARS:
                raise _too_large("an output")
            pieces.append(piece)
        return "".join(pieces)
    except RecursionError:
        raise ChatTemplateError("the chat template recurses without end; the template is broken or hostile") from None
    finally:
        sys.settrace(previous)


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    from jinja2 import TemplateSyntaxError, nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox, with the operators and calls that can multiply a value's size checked first."""

        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context, operator, left, right):
            sizes = [len(v) for v in (left, right) if isinstance(v, (str, list, tuple))]
            counts = [v for v in (left, right) if isinstance(v, int)]
            if (operator == "*" and sizes and counts and sizes[0] * max(counts[0], 0) > RENDER_CHARS) or (
                operator == "+" and sum(sizes) > RENDER_CHARS
            ):
                raise _too_large("a value")
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
                raise ChatTemplateError(
                    f"the chat template raises a number to the power {right}; the template is broken or hostile"
                )
            return _checked_size(super().call_binop(context, operator, left, right))

        def call(self, context, obj, *args, **kwargs):
            if any(isinstance(a, int) and a > RENDER_CHARS for a in (*args, *kwargs.values())):
                raise _too_large("a value")  # 'a'.ljust(10**10), 'x'.center(...)
            if (
                getattr(obj, "__name__", None) == "replace"
                and isinstance(getattr(obj, "__self__", None), str)
                and len(args) >= 2
                and isinstance(args[0], str)
                and isinstance(args[1], str)
            ):
                grows = obj.__self__.count(args[0]) if args[0] else len(obj.__self__) + 1
                if len(obj.__self__) + grows * len(args[1]) > RENDER_CHARS:
                    raise _too_large("a string")
            return _checked_size(super().call(context, obj, *args, **kwargs))

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

    env = BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    for name in (
        "center",
        "indent",
        "format",
        "replace",
        "join",
        "wordwrap",
        "truncate",
    ):  # filters run uncalled by `call`
        env.filters[name] = _size_checked_filter(env.filters[name])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        template = env.from_string(source)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e.message} at line {e.lineno}") from None
    except RecursionError:
        raise ChatTemplateError(
            "the chat template nests too deeply to parse; the template is broken or hostile"
        ) from None
    namespace = template.root_render_func.__globals__  # the compiled template's own module namespace
    for join in ("str_join", "markup_join"):  # `~` and `{{ a }}{{ b }}` concatenation
        namespace[join] = _bounded_join(namespace[join])
    return template


def _size_checked_filter(run):
    """A built-in filter whose numeric arguments and result are held to the size limit."""

    def checked(*args, **kwargs):
        if any(isinstance(a, int) and a > RENDER_CHARS for a in (*args, *kwargs.values())):
            raise _too_large("a value")
        if run.__name__ == "do_replace" and len(args) >= 4 and all(isinstance(a, str) for a in args[1:4]):
            source, old, new = args[1:4]
            if len(source) + (source.count(old) if old else len(source) + 1) * len(new) > RENDER_CHARS:
                raise _too_large("a string")
        return _checked_size(run(*args, **kwargs))

    functools.update_wrapper(checked, run)
    return checked


def _as_json(message: Message) -> dict:
    if isinstance(message.content, str):
        return {"role": message.role, "content": message.content}
    parts = [
        {"type": "text", "text": p.text}
        if p.type == "text"
        else {"type": "image", "image": str(p.image)}
        if p.type == "image"
        else {"type": "audio", "audio": str(p.audio)}
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
        return _render_bounded(_compile(chat_template), variables)
    except ChatTemplateError:
        raise
    except Exception as e:  # the template is a program from a downloaded file: any failure of it is its own
        reason = e.message if isinstance(e, TemplateError) and e.message else f"{type(e).__name__}: {e}"
        raise ChatTemplateError(f"the chat template fails: {' '.join(reason.splitlines())}") from None
