"""A multi-turn chat over one decoder session whose KV cache is kept from turn to turn.

Each turn renders the whole conversation with the chat template (`add_generation_prompt=True`)
and encodes it as `apply_chat_template(tokenize=True)` does: the rendered text already holds the
special tokens the model wants, so none are added. The cache holds the ids of earlier turns; only
what follows their longest common prefix with the new rendering is prefilled. The cursor moves
back to the end of that prefix: attention is causal, so positions past it are never read, and
they are overwritten. Nothing here knows a template: one that re-renders an earlier turn
differently (trims a reply, drops its reasoning) only makes the ids diverge earlier, and more is
prefilled.

A conversation longer than the context goes on: before a turn, the oldest whole turns (a user
message and the replies to it) are dropped until the conversation fills at most half the context,
the system message kept; a reply that still fills the context drops more and goes on from the tokens
it has. What is dropped is gone for later turns too, and what is kept is prefilled again (its
positions moved): the program is not changed, so any runner can do the same
(docs/decisions/0034).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import torch

from genai_pipeline.audio_processing import AudioClip, AudioProcessing, expand_rendered_audio_chat
from genai_pipeline.chat_template import ChatTemplate, render_chat
from genai_pipeline.errors import ChatTemplateError, ContextFullError, InputError
from genai_pipeline.image_processing import Frames, ImageProcessing, expand_rendered_chat
from genai_pipeline.messages import ContentPart, Message
from genai_pipeline.runtime.generate import generate
from genai_pipeline.runtime.lookahead import LookaheadOptions
from genai_pipeline.runtime.multimodal import MultimodalSession, media_runs
from genai_pipeline.runtime.session import Session
from genai_pipeline.tokenizer import END_OF_TURN_TOKENS


class ChatTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class Reply:
    text: str
    tokens: tuple[int, ...]  # without the end-of-turn token
    # "eos": an end-of-turn token; "length": max_new_tokens; "context": the program's context is full
    stop_reason: Literal["eos", "length", "context"]
    reused: int  # conversation tokens whose cache entries were kept from earlier turns
    prefilled: int  # conversation tokens fed before the reply (and again, after a drop mid-reply)
    dropped: int = 0  # the oldest turns dropped so that the conversation fits the context


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def drop_oldest_turns(
    messages: tuple[Message, ...], images: tuple, keep: int, fits: Callable[[tuple[Message, ...], tuple], bool]
) -> tuple[tuple[Message, ...], tuple, int]:
    """(messages, images, turns dropped): the oldest whole turns after the first `keep` messages (the
    system message) dropped until `fits(messages, images)` or only the last message is left. A
    turn is a user message and the messages up to the next one; its images or audio clips (in
    order, one entry per image or audio part) go with it."""
    dropped = 0
    while not fits(messages, images) and len(messages) - keep > 1:
        end = keep + 1
        while end < len(messages) - 1 and messages[end].role != "user":
            end += 1
        images = images[sum(len(m.media) for m in messages[keep:end]) :]
        messages, dropped = messages[:keep] + messages[end:], dropped + 1
    return messages, images, dropped


def fit_conversation(
    messages: tuple[Message, ...],
    images: tuple,
    keep: int,
    context: int,
    room: int,
    render: Callable[[tuple[Message, ...], tuple], list[int]],
) -> tuple[tuple[Message, ...], tuple, int]:
    """(messages, images, turns dropped): the conversation, so that it and `room` more tokens fit
    `context`, the first `keep` messages (the system message) kept. Where turns must go, they go
    until the rest fills at most half the context (llama.cpp's context shift frees half too): the
    turns after reuse the cache until it fills again, instead of each dropping one turn and
    prefilling all the others again (docs/decisions/0034)."""
    if len(render(messages, images)) + room <= context:
        return messages, images, 0
    target = min(context // 2, context - room)
    return drop_oldest_turns(messages, images, keep, lambda m, i: len(render(m, i)) <= target)


def end_of_turn_ids(
    folder: Path, tokenizer: ChatTokenizer, eos_ids: Iterable[int], template: ChatTemplate
) -> tuple[int, ...]:
    """Tokens that end a reply: the manifest's `eos_ids`, generation_config.json's `eos_token_id`
    (an int or a list), and the template's eos_token and END_OF_TURN_TOKENS where the vocabulary
    has them as one token."""
    ids = set(eos_ids)
    config_path = Path(folder) / "generation_config.json"
    if config_path.is_file():
        try:
            configured = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError):
            raise InputError(f"'{config_path}' is not a JSON object; fix or remove it") from None
        configured = [configured] if isinstance(configured, int) else configured if isinstance(configured, list) else []
        ids.update(i for i in configured if isinstance(i, int))
    for text in filter(None, (template.eos_token, *END_OF_TURN_TOKENS)):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == 1:
            ids.add(encoded[0])
    return tuple(sorted(ids))


def conversation_ids(
    tokenizer: ChatTokenizer,
    template: ChatTemplate,
    messages: tuple[Message, ...],
    images: tuple[Frames | AudioClip, ...] = (),
    processing: ImageProcessing | AudioProcessing | None = None,
) -> list[int]:
    """The conversation's ids up to the opening of the assistant's next turn; `images`: the
    conversation's images (or a speech model's audio clips), in order, expanded where the template
    marks them (`processing`: the model's image or audio processing)."""
    try:
        text = render_chat(
            messages,
            template.source,
            bos_token=template.bos_token,
            eos_token=template.eos_token,
            add_generation_prompt=True,
        )
    except ChatTemplateError as e:
        raise ChatTemplateError(f"'{template.origin}': {e}" if template.origin else str(e)) from None
    if images:
        expand = expand_rendered_audio_chat if isinstance(processing, AudioProcessing) else expand_rendered_chat
        text = expand(text, list(images), processing)
    return tokenizer.encode(text, add_special_tokens=False)


def keep_cached(session: Session, cached: list[int], ids: list[int], images: tuple[Frames, ...] = ()) -> int:
    """Keeps the longest prefix of `ids` that the session's cache holds (`cached`: the ids it holds
    from position 0), at least one token short of `ids` (the last one's logits start the reply):
    the cursor moves to its end, and a multimodal session gets the frames whose image tokens come
    after it staged for its prefill. Returns that prefix's length."""
    reused = min(common_prefix_len(cached, ids), len(ids) - 1)
    if isinstance(session, MultimodalSession):
        reused = _stage_frames(session, ids, reused, images)
    session.rewind(reused)
    return reused


def _stage_frames(session: MultimodalSession, ids: list[int], reused: int, images: tuple[Frames, ...]) -> int:
    """Stages for the session's prefill the frames whose image tokens are not in the cache; a
    frame whose run of tokens the cache holds only in part is fed whole. Returns where feeding starts."""
    frames = [frame for f in images for frame in session.encoder_inputs(f)]
    slots = [i for i, t in enumerate(ids) if t == session.media_token_id]
    runs = media_runs(slots, [session.tokens_of(f) for f in frames], session.modality, "the conversation")
    for run in runs:
        if run[0] < reused <= run[-1]:
            reused = run[0]
    session.frames = [frame for frame, run in zip(frames, runs) if run[0] >= reused]
    return reused


class Chat:
    """A conversation: `send` a user message, get the assistant's reply (streamed to `on_token`)."""

    def __init__(
        self,
        session: Session,
        tokenizer: ChatTokenizer,
        template: ChatTemplate,
        sampler: Callable[[torch.Tensor], int],
        stop_ids: tuple[int, ...],
        max_new_tokens: int,
        system: str | None = None,
        lookahead: LookaheadOptions = LookaheadOptions(),
    ):
        if max_new_tokens < 1:
            raise InputError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
        self.session = session
        self.tokenizer = tokenizer
        self.template = template
        self.sampler = sampler
        self.stop_ids = stop_ids
        self.max_new_tokens = max_new_tokens
        self.lookahead = lookahead
        self.takes_images = isinstance(session, MultimodalSession) and session.modality == "image"
        self.takes_audio = isinstance(session, MultimodalSession) and session.modality == "audio"
        self.first_messages = (self._message("system", system),) if system else ()
        self.reset()

    def reset(self) -> None:
        """Forget the conversation and any attached image (the system message stays)."""
        self.messages: tuple[Message, ...] = self.first_messages
        self.images: tuple[Frames | AudioClip, ...] = ()  # the conversation's images (audio clips), in order
        self.attached: tuple[tuple[Path, Frames | AudioClip], ...] = ()  # images (audio) for the next user message
        self.cached: list[int] = []  # the ids whose keys and values the cache holds, from position 0
        self.session.reset()

    def attach_image(self, path: Path, max_tiles: int = 0) -> None:
        """An image for the next user message, read and preprocessed now (a bad file is told at once)."""
        if not self.takes_images:
            raise InputError(f"this is a {'speech' if self.takes_audio else 'text-only'} model: it cannot take images")
        self.attached = (*self.attached, (Path(path), self.session.read_frames(Path(path), max_tiles)))

    def attach_audio(self, path: Path) -> None:
        """An audio file for the next user message, read and preprocessed now (a bad file is told at once)."""
        if not self.takes_audio:
            raise InputError(
                f"this is a {'vision-language' if self.takes_images else 'text-only'} model: it cannot take audio"
            )
        self.attached = (*self.attached, (Path(path), self.session.read_audio(Path(path))))

    def _message(self, role: str, text: str, media: tuple[Path, ...] = ()) -> Message:
        if not (self.takes_images or self.takes_audio):
            return Message(role, text)
        kind = "image" if self.takes_images else "audio"
        return Message(role, (*(ContentPart(kind, **{kind: p}) for p in media), ContentPart("text", text=text)))

    def render(self, messages: tuple[Message, ...], images: tuple[Frames | AudioClip, ...] = ()) -> list[int]:
        processing = self.session.processing if self.takes_images or self.takes_audio else None
        return conversation_ids(self.tokenizer, self.template, messages, images, processing)

    def send(self, text: str, on_token: Callable[[int], None] | None = None) -> Reply:
        """Add a user message (with the attached images) and generate the reply, dropping the oldest
        turns where the context needs it. ContextFullError (this message alone does not fit) and
        InputError leave the conversation as it was, the attached images still attached."""
        messages = (*self.messages, self._message("user", text, tuple(p for p, _ in self.attached)))
        images = (*self.images, *(f for _, f in self.attached))
        context = self.session.max_seq_len
        # Room for the whole reply where the context allows; half of it at most, so that a long
        # reply does not push out every earlier turn.
        room = min(self.max_new_tokens, context // 2)
        messages, images, dropped = self._fit(messages, images, room)
        ids = self.render(messages, images)
        if len(ids) >= context:
            raise ContextFullError(
                f"the message would make the conversation {len(ids)} tokens; the program's context is {context}"
            )
        tokens: list[int] = []
        reused = None  # the cache kept from earlier turns: the first feed's
        prefilled = 0
        while True:
            fed, stop, kept = self._generate(ids + tokens, self.max_new_tokens - len(tokens), images, on_token)
            reused = kept if reused is None else reused
            prefilled += fed
            tokens += stop.tokens
            if stop.stop_reason == "eos" or len(tokens) >= self.max_new_tokens:
                reason = stop.stop_reason
                break
            # The context filled mid-reply: drop older turns and go on from the reply so far.
            kept, images_kept, more = self._fit(messages, images, room + len(tokens))
            if not more:
                reason = "context"
                break
            messages, images, dropped = kept, images_kept, dropped + more
            ids = self.render(messages, images)
        reply_text = self.tokenizer.decode(tokens)
        self.messages = (*messages, self._message("assistant", reply_text))
        self.images, self.attached = images, ()
        return Reply(reply_text, tuple(tokens), reason, reused, prefilled, dropped)

    def _fit(self, messages: tuple[Message, ...], images: tuple[Frames, ...], room: int):
        return fit_conversation(messages, images, len(self.first_messages), self.session.max_seq_len, room, self.render)

    def _generate(self, prompt: list[int], budget: int, images: tuple[Frames, ...], on_token):
        """Feeds what of `prompt` the cache does not hold and generates up to `budget` tokens or to
        the end of the context: (tokens fed, the generation, tokens kept from the cache)."""
        reused = keep_cached(self.session, self.cached, prompt, images)
        self.cached = prompt[:reused]  # until generation returns, only this much is known to be in the cache
        room = self.session.max_seq_len - len(prompt) + 1  # the last generated token is never fed back
        # Lookahead drafts from the whole conversation: a reply often quotes earlier turns.
        result = generate(
            self.session,
            prompt[reused:],
            min(budget, room),
            self.sampler,
            self.stop_ids,
            on_token,
            lookahead=self.lookahead,
            history=prompt[:reused],
        )
        # Everything fed is cached: the prompt, and each reply token but one that ended the reply.
        self.cached = (prompt + result.tokens)[: self.session.pos]
        return len(prompt) - reused, result, reused
