"""The HTTP side of `genai serve`: OpenAI's routes as a Starlette app, run by uvicorn.

Starlette and uvicorn rather than FastAPI: requests are checked by requests.py into frozen
dataclasses with OpenAI's own error messages, so FastAPI's pydantic models and OpenAPI pages
would be a second schema to keep in step; Starlette is the ASGI toolkit FastAPI itself is built
on, and its StreamingResponse already sends server-sent events and cancels the stream when the
client disconnects (the generation then stops at its next token).

Every error is OpenAI's error object with a 4xx status (5xx only for a fault of the server), and
the server goes on serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from genai_pipeline.errors import GenAIError, InputError
from genai_pipeline.limits import REQUEST_BYTES
from genai_pipeline.serve.engine import Engine, Finished, Job
from genai_pipeline.serve.requests import RequestError, check_model, parse_chat, parse_completion, parse_json

log = logging.getLogger(__name__)


def create_app(engine: Engine) -> Starlette:
    async def chat_completions(request: Request) -> Response:
        data = parse_json(await read_body(request))
        job = await prepared(engine.chat_job, parse_chat(data, engine.model))
        return await respond(request, engine, job, ChatFormat(engine.model.id))

    async def completions(request: Request) -> Response:
        data = parse_json(await read_body(request))
        job = await prepared(engine.completion_job, parse_completion(data, engine.model))
        return await respond(request, engine, job, CompletionFormat(engine.model.id))

    async def models(request: Request) -> Response:
        card = {"id": engine.model.id, "object": "model", "created": 0, "owned_by": "genai"}
        return JSONResponse({"object": "list", "data": [card]})

    async def model(request: Request) -> Response:
        check_model({"model": request.path_params["name"]}, engine.model)
        return JSONResponse({"id": engine.model.id, "object": "model", "created": 0, "owned_by": "genai"})

    async def health(request: Request) -> Response:
        e = engine
        counts = {"busy": e.busy, "queued": e.waiting, "served": e.served, "abandoned": e.abandoned}
        return JSONResponse({"status": "ok", "model": e.model.id, "sessions": len(e.slots), **counts})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.close)

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{name:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={RequestError: refused, GenAIError: refused, HTTPException: refused, Exception: failed},
        lifespan=lifespan,
    )


async def read_body(request: Request) -> bytes:
    """The body, read no further than REQUEST_BYTES."""
    limit = REQUEST_BYTES.value()
    too_large = RequestError(
        413, f"the request body is over this server's limit of {limit:,} bytes ({REQUEST_BYTES.variable})"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:
        raise RequestError(400, "the client disconnected before sending the whole body") from None
    return bytes(body)


async def prepared(make_job, request) -> Job:
    """The request's job, made in a worker thread: rendering, tokenizing and decoding images take time."""
    try:
        return await asyncio.to_thread(make_job, request)
    except InputError as e:  # a broken image, an image the template does not place, ...
        raise RequestError(400, str(e)) from None


async def refused(request: Request, error: Exception) -> Response:
    if isinstance(error, HTTPException):
        error = RequestError(
            error.status_code, error.detail if error.status_code != 404 else f"no route {request.url.path}"
        )
    elif not isinstance(error, RequestError):  # a GenAIError: what the user sent cannot be served
        error = RequestError(400, str(error))
    return JSONResponse(error.body, status_code=error.status)


async def failed(request: Request, error: Exception) -> Response:
    log.error("internal error on %s", request.url.path, exc_info=error)
    body = RequestError(500, f"internal error: {type(error).__name__}: {error}").body
    return JSONResponse(body, status_code=500)


class ChatFormat:
    """Chat completion objects and chunks."""

    def __init__(self, model: str):
        self.id, self.model, self.created = f"chatcmpl-{uuid.uuid4().hex}", model, int(time.time())

    def _object(self, kind: str, choice: dict, usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}
        return body if usage is None else {**body, "usage": usage}

    def whole(self, done: Finished) -> dict:
        message = {"role": "assistant", "content": done.text}
        choice = {"index": 0, "message": message, "finish_reason": done.finish_reason, "logprobs": None}
        return self._object("chat.completion", choice, usage(done))

    def opening(self) -> dict | None:
        return self._object("chat.completion.chunk", {"index": 0, "delta": {"role": "assistant", "content": ""}})

    def piece(self, text: str) -> dict:
        return self._object("chat.completion.chunk", {"index": 0, "delta": {"content": text}, "finish_reason": None})

    def closing(self, done: Finished) -> dict:
        return self._object("chat.completion.chunk", {"index": 0, "delta": {}, "finish_reason": done.finish_reason})

    def usage_chunk(self, done: Finished) -> dict:
        return {**self._object("chat.completion.chunk", {}), "choices": [], "usage": usage(done)}


class CompletionFormat(ChatFormat):
    """Text completion objects; a stream's chunks are text completions too."""

    def __init__(self, model: str):
        super().__init__(model)
        self.id = f"cmpl-{uuid.uuid4().hex}"

    def whole(self, done: Finished) -> dict:
        choice = {"index": 0, "text": done.text, "finish_reason": done.finish_reason, "logprobs": None}
        return self._object("text_completion", choice, usage(done))

    def opening(self) -> None:
        return None

    def piece(self, text: str) -> dict:
        return self._object("text_completion", {"index": 0, "text": text, "finish_reason": None, "logprobs": None})

    def closing(self, done: Finished) -> dict:
        return self._object("text_completion", {"index": 0, "text": "", "finish_reason": done.finish_reason})

    def usage_chunk(self, done: Finished) -> dict:
        return {**self._object("text_completion", {}), "choices": [], "usage": usage(done)}


def usage(done: Finished) -> dict:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


async def respond(request: Request, engine: Engine, job: Job, form: ChatFormat) -> Response:
    engine.admit()
    if job.decoding.stream:
        headers = {"Cache-Control": "no-cache"}
        return StreamingResponse(stream(engine, job, form), media_type="text/event-stream", headers=headers)
    async with contextlib.aclosing(engine.run(job)) as events:
        async for event in events:
            if await request.is_disconnected():  # the client gave up: closing the events stops the generation
                return Response(status_code=499)
            done = event
    return JSONResponse(form.whole(done))


async def stream(engine: Engine, job: Job, form: ChatFormat):
    """Server-sent events: the opening chunk, a chunk per text piece, the closing one (its
    finish_reason), the usage on request, then [DONE]. An error after the first byte is an error
    event, as OpenAI's API sends it."""

    def event(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    if (opening := form.opening()) is not None:
        yield event(opening)
    try:
        async with contextlib.aclosing(engine.run(job)) as events:
            async for piece in events:
                if not isinstance(piece, Finished):
                    yield event(form.piece(piece))
                    continue
                yield event(form.closing(piece))
                if job.decoding.include_usage:
                    yield event(form.usage_chunk(piece))
    except Exception as e:  # noqa: BLE001  the status line is sent: the error goes in the stream
        log.error("internal error while streaming", exc_info=e)
        yield event(RequestError(500, f"internal error: {type(e).__name__}: {e}").body)
    yield "data: [DONE]\n\n"


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one), made before the server starts: the
    address it says is the one it has, and a client that connects at once waits in the backlog."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's backlog
    except OSError as e:
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def serve(engine: Engine, sock: socket.socket) -> None:
    """Serves until SIGINT or SIGTERM, then returns: streams still open after a few seconds are
    closed, and the generations under way stop at their next token."""
    import uvicorn

    # log_config None: uvicorn's loggers keep the handlers they were given (the command's).
    config = uvicorn.Config(
        create_app(engine), log_config=None, log_level="warning", access_log=False, timeout_graceful_shutdown=5
    )
    # uvicorn shuts down on these signals, then raises them again for the handlers it found: these
    # note them, so that a stop asked for is a normal end, not an interrupted command.
    found = {s: signal.signal(s, lambda signum, frame: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        for s, handler in found.items():
            signal.signal(s, handler)
