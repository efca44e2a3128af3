"""Messages and samples, shared by calibration data, the chat template and the runtime's chat: a
sample is plain text or a chat (messages whose content may hold images).

`messages_from_json` reads the Hugging Face chat form, shared by the `messages` and `hf-chat`
datasets:

    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    [{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                  {"type": "text", "text": "What is this?"}]}]

An image part names a local file (key `image`, `path` or `url`), relative to the data file's
folder; it must exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from genai_pipeline.errors import DataError

IMAGE_KEYS = ("image", "path", "url")


@dataclass(frozen=True)
class ContentPart:
    type: Literal["text", "image", "audio"]
    text: str | None = None  # type "text"
    image: Path | None = None  # type "image"
    audio: Path | None = None  # type "audio" (a speech model's chat)

    def __post_init__(self):
        if self.type not in ("text", "image", "audio"):
            raise ValueError(f"content part type must be 'text', 'image' or 'audio', got {self.type!r}")
        if self.type == "text" and not isinstance(self.text, str):
            raise ValueError("a text part needs text")
        if self.type == "image" and not isinstance(self.image, Path):
            raise ValueError("an image part needs an image path")
        if self.type == "audio" and not isinstance(self.audio, Path):
            raise ValueError("an audio part needs an audio file's path")


@dataclass(frozen=True)
class Message:
    role: str
    content: str | tuple[ContentPart, ...]

    def __post_init__(self):
        if not isinstance(self.role, str) or not self.role:
            raise ValueError(f"a message needs a role, got {self.role!r}")
        if not isinstance(self.content, str) and not (
            isinstance(self.content, tuple) and all(isinstance(p, ContentPart) for p in self.content)
        ):
            raise ValueError(f"message content must be a str or a tuple of ContentPart, got {self.content!r:.60}")

    @property
    def images(self) -> tuple[Path, ...]:
        parts = () if isinstance(self.content, str) else self.content
        return tuple(p.image for p in parts if p.type == "image")

    @property
    def media(self) -> tuple[Path, ...]:
        """The files of the image and audio parts, in order."""
        parts = () if isinstance(self.content, str) else self.content
        return tuple(p.image if p.type == "image" else p.audio for p in parts if p.type != "text")

    @property
    def text(self) -> str:
        """The content's text, image and audio parts left out."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if p.type == "text")


@dataclass(frozen=True)
class Sample:
    """Exactly one of `text` or `messages`. `images` are the chat's image parts, in order (filled
    in from `messages` when not given). `origin` says where the sample came from, for errors."""

    text: str | None = None
    messages: tuple[Message, ...] | None = None
    images: tuple[Path, ...] = ()
    origin: str = ""

    def __post_init__(self):
        if (self.text is None) == (self.messages is None):
            raise ValueError("a Sample holds either text or messages")
        if self.text is not None:
            if self.images:
                raise ValueError("a text Sample has no images; put images in message content")
            return
        messages = tuple(self.messages)
        if not messages:
            raise ValueError("a chat Sample needs at least one message")
        object.__setattr__(self, "messages", messages)
        images = tuple(image for m in messages for image in m.images)
        if self.images and tuple(self.images) != images:
            raise ValueError(f"images {self.images} differ from the image parts of the messages {images}")
        object.__setattr__(self, "images", images)


def _part(raw: Any, where: str, base: Path) -> ContentPart:
    if not isinstance(raw, dict) or "type" not in raw:
        raise DataError(f"{where}: a content part must be an object with a 'type', got {str(raw)[:60]}")
    kind = raw["type"]
    if kind == "text":
        if not isinstance(raw.get("text"), str):
            raise DataError(f"{where}: a text part needs a string 'text'")
        return ContentPart("text", text=raw["text"])
    if kind == "image":
        name = next((raw[k] for k in IMAGE_KEYS if isinstance(raw.get(k), str)), None)
        if name is None:
            raise DataError(f"{where}: an image part needs a file name in one of {', '.join(IMAGE_KEYS)}")
        if name.startswith(("http://", "https://")):
            raise DataError(f"{where}: image '{name}' is a URL; nothing is downloaded, save it next to the data file")
        path = base / name
        if not path.is_file():
            raise DataError(f"{where}: image file '{path}' does not exist")
        return ContentPart("image", image=path)
    raise DataError(f"{where}: unsupported content part type {kind!r}; use 'text' or 'image'")


def message_from_json(raw: Any, where: str, base: Path) -> Message:
    if not isinstance(raw, dict):
        raise DataError(f"{where}: a message must be an object with 'role' and 'content', got {str(raw)[:60]}")
    role, content = raw.get("role"), raw.get("content")
    if not isinstance(role, str) or not role:
        raise DataError(f"{where}: message has no 'role'")
    if isinstance(content, str):
        return Message(role, content)
    if isinstance(content, list):
        parts = tuple(
            # Arrow fills a struct's absent fields with None: drop them before reading the part.
            _part(
                {k: v for k, v in p.items() if v is not None} if isinstance(p, dict) else p, f"{where}, part {j}", base
            )
            for j, p in enumerate(content)
        )
        return Message(role, parts)
    raise DataError(f"{where}: message has no 'content' (a string or a list of parts)")


def messages_from_json(raw: Any, where: str, base: Path) -> tuple[Message, ...]:
    """A list of Hugging Face chat messages -> Messages; image paths resolved against `base`."""
    if not isinstance(raw, list) or not raw:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    return tuple(message_from_json(m, f"{where}, message {i}", base) for i, m in enumerate(raw))


def nonempty(samples: list[Sample], source: str) -> list[Sample]:
    if not samples:
        raise DataError(f"calibration data {source} holds no samples")
    return samples
