"""The program behind the server: N sessions (each its own KV cache; XNNPACK's weights cache packs
the weights once for all), a queue in front of them, and the generation loop run in a thread per
session, its text handed to the event loop as it comes.

A request goes to the free session whose cache holds the longest prefix of its prompt, and only
the rest is prefilled (runtime/chat.py's `keep_cached`, as `genai run --chat` does from turn to
turn): a multi-turn client pays for each turn once, as long as its session is not taken by
another conversation in between. Requests beyond the free sessions wait in arrival order; past
QUEUED_REQUESTS they are turned away (429).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from genai_pipeline.chat_template import read_chat_template
from genai_pipeline.errors import InputError
from genai_pipeline.image_files import decode_image
from genai_pipeline.image_processing import Frames, frame_tokens, image_frames
from genai_pipeline.limits import QUEUED_REQUESTS, REQUEST_BYTES, REQUEST_IMAGES, REQUEST_MESSAGES, REQUEST_PARTS
from genai_pipeline.manifest import Manifest
from genai_pipeline.messages import Message
from genai_pipeline.runtime.chat import (
    common_prefix_len,
    conversation_ids,
    end_of_turn_ids,
    fit_conversation,
    keep_cached,
)
from genai_pipeline.runtime.generate import Sampler, generate
from genai_pipeline.runtime.lookahead import LookaheadOptions, lookahead_options
from genai_pipeline.runtime.multimodal import is_multimodal
from genai_pipeline.runtime.open import open_session
from genai_pipeline.runtime.session import Session
from genai_pipeline.serve.requests import ChatRequest, CompletionRequest, Decoding, RequestError, ServedModel
from genai_pipeline.tokenizer import TextStream

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """One request's work for the program: its prompt as ids, its images' frames, how to decode."""

    ids: tuple[int, ...]
    images: tuple[Frames, ...]
    decoding: Decoding
    stop_ids: tuple[int, ...]  # tokens that end the reply (not part of it)
    keys: tuple  # the ids as the cache tells prompts apart (cache_keys)


def cache_keys(ids: list[int], images: tuple[Frames, ...], image_token_id: int, counts: list[int]) -> tuple:
    """A prompt's ids with each image token standing as (its frame's digest, its place), `counts`
    the tokens of each frame: every image is the same run of ids, so two prompts share a cached
    prefix only as far as their images are the same pixels too."""
    digests = [hashlib.blake2b(frame.tobytes(), digest_size=16).digest() for f in images for frame in f.pixels]
    owners = [digest for digest, n in zip(digests, counts) for _ in range(n)]
    keys, k = [], 0
    for t in ids:
        if t == image_token_id and k < len(owners):
            keys.append((owners[k], k))
            k += 1
        else:
            keys.append(t)
    return tuple(keys)


@dataclass(frozen=True)
class Finished:
    text: str
    finish_reason: Literal["stop", "length"]
    prompt_tokens: int
    cached_tokens: int  # of the prompt, kept in the session's cache from an earlier request
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    error: BaseException


class StopText:
    """A reply's text as its tokens come, ended before the first stop string. Text that may be the
    start of a stop string is held back until it is known not to be one."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.stream, self.stops = TextStream(tokenizer), stops
        self.text, self.sent, self.stopped = "", 0, False

    def push(self, token: int) -> str:
        self.text += self.stream.push(token)
        return self._release(final=False)

    def flush(self) -> str:
        if not self.stopped:
            self.text += self.stream.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        # A stop string starts at or after `sent`: text that could begin one is never sent.
        found = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if found:
            self.text, self.stopped, final = self.text[: min(found)], True, True
        end = len(self.text) if final else len(self.text) - self._held()
        piece, self.sent = self.text[self.sent : end], max(self.sent, end)
        return piece

    def _held(self) -> int:
        """The longest end of the text that is the start of a stop string."""
        return max(
            (n for s in self.stops for n in range(min(len(s) - 1, len(self.text)), 0, -1) if self.text.endswith(s[:n])),
            default=0,
        )


class Slot:
    """One session and the ids its KV cache holds, from position 0."""

    def __init__(self, session: Session):
        self.session = session
        self.cached: list[int] = []
        self.keys: list = []  # the same, as cache_keys
        self.last_used = 0  # the Engine's count of requests when it last took this session

    def run(self, job: Job, tokenizer, lookahead: LookaheadOptions, emit: Callable, cancel: threading.Event) -> bool:
        """Generates `job`'s reply in this thread: its text to `emit` as it comes, then Finished.
        Returns whether it was cut short by `cancel`."""
        ids, session = list(job.ids), self.session
        same = common_prefix_len(self.keys, list(job.keys))  # past it the ids may match, the images not
        reused = keep_cached(session, self.cached[:same], ids, job.images)
        # Until generation returns, only this much is known to be in the cache.
        self.cached, self.keys = ids[:reused], list(job.keys[:reused])
        room = session.max_seq_len - len(ids) + 1  # the last generated token is never fed back
        max_new = min(job.decoding.max_tokens or room, room)
        text = StopText(tokenizer, job.decoding.stop)

        def on_token(token: int) -> bool:
            if piece := text.push(token):
                emit(piece)
            return text.stopped or cancel.is_set()

        result = generate(
            session,
            ids[reused:],
            max_new,
            Sampler(job.decoding.sampling),
            job.stop_ids,
            on_token,
            lookahead=lookahead,
            history=ids[:reused],
        )
        # Everything fed is cached: the prompt, and each reply token but the last.
        self.cached = (ids + result.tokens)[: session.pos]
        self.keys = [*job.keys, *result.tokens][: session.pos]
        if piece := text.flush():
            emit(piece)
        reason = "length" if result.stop_reason == "length" and not text.stopped else "stop"
        emit(Finished(text.text, reason, len(ids), reused, len(result.tokens)))
        return result.stop_reason == "stopped" and not text.stopped


class Engine:
    def __init__(self, folder: Path, parallel: int = 1, lookahead: int = 0, verify: bool = True):
        folder = Path(folder)
        if parallel < 1:
            raise InputError(f"--parallel must be at least 1, got {parallel}")
        for limit in (REQUEST_BYTES, REQUEST_MESSAGES, REQUEST_PARTS, REQUEST_IMAGES, QUEUED_REQUESTS):
            limit.value()  # a malformed variable stops the server at its start, not at a request
        manifest = Manifest.read(folder)
        manifest.refuse_speech(folder, "genai serve")
        self.multimodal = is_multimodal(manifest)
        # Only the first session checks the program's sha256: the others load the same file.
        sessions = [open_session(folder, verify and i == 0) for i in range(parallel)]
        self.processing = sessions[0].processing if self.multimodal else None
        self.tokenizer = manifest.tokenizer(folder)
        self.template = read_chat_template(folder)
        eos_ids = manifest.eos_ids
        self.chat_stop_ids = end_of_turn_ids(folder, self.tokenizer, eos_ids, self.template) if self.template else ()
        self.eos_ids = eos_ids
        self.lookahead = lookahead_options(lookahead, sessions[0])
        self.vocab_size = manifest.config.vocab_size
        self.model = ServedModel(manifest.model, sessions[0].max_seq_len, self.multimodal)
        self.slots = [Slot(s) for s in sessions]
        self.free = list(self.slots)
        self.turns = asyncio.Semaphore(parallel)
        self.waiting = 0
        self.requests = 0  # taken a session
        self.served = 0  # generations finished
        self.abandoned = 0  # of which, stopped early because their client went away
        self.running: set[threading.Event] = set()  # the cancel flags of the generations under way
        self.threads = ThreadPoolExecutor(parallel, thread_name_prefix="genai-session")

    # ---- requests -> jobs (run in a worker thread: templates, tokenizing and images take time)

    def chat_job(self, request: ChatRequest) -> Job:
        if self.template is None:
            raise RequestError(
                400,
                f"the model '{self.model.id}' has no chat template in its export folder; /v1/completions takes "
                "a raw prompt",
            )
        frames = tuple(
            image_frames(decode_image(io.BytesIO(data), f"image {k + 1}"), self.processing)
            for k, data in enumerate(request.images)
        )
        messages, frames = self._fit(request.messages, frames, request.decoding.max_tokens)
        ids = conversation_ids(self.tokenizer, self.template, messages, frames, self.processing)
        keys = tuple(ids)
        if self.multimodal:
            image_token_id = self.slots[0].session.image_token_id
            counts = [frame_tokens(frame, self.processing) for f in frames for frame in f.pixels]
            found = ids.count(image_token_id)
            if found != sum(counts):
                raise RequestError(
                    400,
                    f"the conversation holds {found} image tokens for {len(frames)} image(s) that take {sum(counts)}: "
                    "images go in image_url parts, not in the text",
                    "messages",
                )
            keys = cache_keys(ids, frames, image_token_id, counts)
        return self._job(ids, frames, request.decoding, self.chat_stop_ids, keys, "messages")

    def _fit(self, messages: tuple[Message, ...], frames: tuple, max_tokens: int | None):
        """A conversation longer than the context keeps its system messages and its latest turns, as
        `genai run --chat` does; only a last message that alone does not fit is refused (below)."""
        context = self.model.context
        room = min(max_tokens or context // 2, context // 2)
        keep = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
        kept, kept_frames, _ = fit_conversation(
            messages,
            frames,
            keep,
            context,
            room,
            lambda m, f: conversation_ids(self.tokenizer, self.template, m, f, self.processing),
        )
        return kept, kept_frames

    def completion_job(self, request: CompletionRequest) -> Job:
        if isinstance(request.prompt, str):
            ids = self.tokenizer.encode(request.prompt)
        elif all(0 <= t < self.vocab_size for t in request.prompt):
            ids = list(request.prompt)
        else:
            raise RequestError(400, f"a token id of 'prompt' is outside the vocabulary of {self.vocab_size}", "prompt")
        if self.multimodal and self.slots[0].session.image_token_id in ids:
            raise RequestError(
                400, "the prompt holds image tokens: images go in /v1/chat/completions as image_url parts", "prompt"
            )
        return self._job(ids, (), request.decoding, self.eos_ids, tuple(ids), "prompt")

    def _job(self, ids: list[int], frames, decoding: Decoding, stop_ids, keys: tuple, param: str) -> Job:
        context = self.model.context
        if not ids:
            raise RequestError(400, "the prompt is empty", param)
        if len(ids) >= context:
            raise RequestError(
                400,
                f"the prompt is {len(ids)} tokens; the model's context is {context}, and a reply needs at least one",
                param,
                "context_length_exceeded",
            )
        return Job(tuple(ids), frames, decoding, stop_ids, keys)

    # ---- the queue and the sessions

    def admit(self) -> None:
        """Turns a request away at once when the queue is full."""
        if self.waiting >= QUEUED_REQUESTS.value():
            raise RequestError(
                429,
                f"the server is busy: {self.waiting} requests are waiting for its {len(self.slots)} session(s); "
                "retry later",
            )

    @property
    def busy(self) -> int:
        return len(self.slots) - len(self.free)

    async def run(self, job: Job) -> AsyncIterator[str | Finished]:
        """The reply's text pieces as they come, then Finished. Closing the iterator early (the
        client went away) stops the generation at its next token."""
        self.waiting += 1
        try:
            await self.turns.acquire()
        finally:
            self.waiting -= 1
        # The free session whose cache holds the longest prefix of the prompt; of equals, the one
        # used least recently (a conversation's session is taken last).
        slot = max(self.free, key=lambda s: (common_prefix_len(s.keys, list(job.keys)), -s.last_used))
        self.free.remove(slot)
        self.requests += 1
        slot.last_used = self.requests
        loop, events, cancel = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()

        def emit(event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        def work() -> bool | None:
            try:
                return slot.run(job, self.tokenizer, self.lookahead, emit, cancel)
            except BaseException as e:  # noqa: BLE001  the event loop tells the client
                slot.cached, slot.keys = [], []  # what the cache holds is not known
                emit(Failed(e))

        def give_back() -> None:
            self.running.discard(cancel)
            self.free.append(slot)
            self.turns.release()

        def done(future) -> None:
            self.served += 1
            self.abandoned += not future.cancelled() and future.exception() is None and future.result() is True
            give_back()

        try:
            future = loop.run_in_executor(self.threads, work)
        except BaseException:
            give_back()
            raise
        self.running.add(cancel)
        future.add_done_callback(done)
        try:
            while True:
                event = await events.get()
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Finished):
                    # The session is free again before the reply goes out: a client's next turn
                    # finds the session that holds its conversation.
                    await asyncio.shield(future)
                    yield event
                    return
                yield event
        finally:
            cancel.set()

    def close(self) -> None:
        """Stops the generations under way at their next token; waits for their threads."""
        for cancel in list(self.running):
            cancel.set()
        self.threads.shutdown(wait=True)
