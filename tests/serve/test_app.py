"""`genai serve` on the real SmolLM2-135M-Instruct, through the official `openai` client against a
live server on loopback: chat (streamed and not), completions, sampling and stop strings, a
multi-turn conversation that prefills each turn once, concurrent requests on two sessions, a
client that leaves mid-stream or gives up waiting, and every bad request answered with a 4xx while
the server goes on."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from live import LiveServer

MODEL = "smollm2-135m"
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
BODY_LIMIT = 1_000_000
MESSAGES_LIMIT = 64


@pytest.fixture(scope="module")
def server(smollm2_fp32):
    """Two sessions, lookahead on (the export has a `verify` method), and lowered request limits."""
    env = {"GENAI_MAX_REQUEST_BYTES": str(BODY_LIMIT), "GENAI_MAX_REQUEST_MESSAGES": str(MESSAGES_LIMIT)}
    live = LiveServer(smollm2_fp32, "--parallel", "2", "--lookahead", "7", env=env)
    yield live
    assert live.stop() == 0, live.log  # SIGTERM is a normal stop
    assert live.log.strip().endswith("genai: stopped"), live.log


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def health(server) -> dict:
    return json.load(urllib.request.urlopen(server.url.removesuffix("/v1") + "/health"))


def post(server, path: str, body: bytes) -> tuple[int, dict]:
    """A raw POST, for what the client cannot send (bad JSON, oversized bodies). The server may
    answer an oversized body before reading it and close: the answer is read even when sending the
    rest of the body then breaks the pipe."""
    url = urllib.parse.urlsplit(server.url + path)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        connection.putrequest("POST", url.path)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(len(body)))
        connection.endheaders()
        try:
            connection.send(body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        response = connection.getresponse()
        return response.status, json.load(response)
    finally:
        connection.close()


def test_binds_to_loopback_by_default_and_says_so(server, client):
    assert server.url.startswith("http://127.0.0.1:")
    assert "to this machine only (loopback" in server.log
    assert [m.id for m in client.models.list()] == [MODEL]
    assert health(server)["status"] == "ok" and health(server)["sessions"] == 2


def test_chat_answers_the_capital_of_france(client):
    reply = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=24)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens < 24
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streamed_chat_answers_the_capital_of_france(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CAPITAL,
            temperature=0,
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens >= len([c for c in chunks if c.choices and c.choices[0].delta.content])
    whole = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=24)
    assert whole.choices[0].message.content == text


def test_max_tokens_ends_with_length_and_stop_strings_with_stop(client):
    short = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=2)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2
    stopped = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=24, stop=["Par"])
    assert stopped.choices[0].finish_reason == "stop"
    text = stopped.choices[0].message.content
    assert "Par" not in text and text.endswith("is ")
    streamed = client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_tokens=24, stop="Par", stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text


def test_a_seed_repeats_a_sampled_reply(client):
    def sampled(seed: int) -> str:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=CAPITAL,
            temperature=1.0,
            top_p=0.9,
            max_tokens=12,
            seed=seed,
            extra_body={"top_k": 40},
        )
        return reply.choices[0].message.content

    assert sampled(7) == sampled(7)


def test_completions_continue_a_raw_prompt(client):
    prompt = "The capital of France is"
    reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=3)
    assert "Paris" in reply.choices[0].text and reply.choices[0].finish_reason == "length"
    streamed = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text


def test_each_turn_of_a_conversation_is_prefilled_once(client):
    """Turn k's prompt is turn k-1's prompt, its reply, and the new message: the cache holds the
    first two (the reply ended at its end-of-turn token, which was never fed), so only the new
    message and the template's markers around it are prefilled."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    previous = None
    for question in ("What is the capital of France?", "And of Germany?", "Which river flows through it?"):
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
        usage = reply.usage
        if previous is not None:
            assert previous.choices[0].finish_reason == "stop"
            kept = previous.usage.prompt_tokens + previous.usage.completion_tokens
            assert usage.prompt_tokens_details.cached_tokens == kept
            prefilled = usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens
            assert 0 < prefilled <= 20  # the new question and the markers of two turns
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        previous = reply


def test_a_conversation_longer_than_the_context_keeps_its_system_message_and_latest_turns(client):
    """A history past the 512-token context is answered, not refused: the oldest turns leave until the
    rest fills half the context (as `genai run --chat` does), the system message stays, and the
    answer is the one the kept conversation gets alone."""
    system = {"role": "system", "content": "You are a helpful assistant. The password is BLUEBIRD."}
    turns = []
    for k in range(12):
        turns += [
            {"role": "user", "content": f"Tell me fact number {k} about rivers, in one long sentence."},
            {"role": "assistant", "content": "Rivers carry water from the mountains down to the sea. " * 3},
        ]
    question = {"role": "user", "content": "What is the password?"}
    reply = client.chat.completions.create(
        model=MODEL, messages=[system, *turns, question], temperature=0, max_tokens=24
    )
    assert reply.choices[0].finish_reason == "stop" and reply.usage.prompt_tokens <= 256
    kept = reply.usage.prompt_tokens
    alone = [None]
    for n in range(0, len(turns) + 1, 2):  # the kept conversation: the system message and the latest turns
        trial = client.chat.completions.create(
            model=MODEL, messages=[system, *turns[n:], question], temperature=0, max_tokens=24
        )
        if trial.usage.prompt_tokens == kept:
            alone = [trial.choices[0].message.content]
            break
    assert alone == [reply.choices[0].message.content]


def test_concurrent_requests_get_the_replies_each_gets_alone(client):
    """Four streams at once on two sessions (two wait in the queue): each greedy reply is the one
    its request gets alone."""
    questions = [f"What is the capital of {country}?" for country in ("France", "Germany", "Spain", "Japan")]

    def ask(question: str) -> str:
        messages = [{"role": "user", "content": question}]
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=16, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream)

    alone = [ask(q) for q in questions]
    with ThreadPoolExecutor(len(questions)) as pool:
        assert list(pool.map(ask, questions)) == alone
    assert "Paris" in alone[0] and "Berlin" in alone[1]


STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]


def stops_early(server, leave) -> None:
    """`leave()` starts a long reply and goes away: the server stops generating it early."""
    before = health(server)
    leave()
    deadline = time.monotonic() + 60
    while (now := health(server))["served"] == before["served"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert now["abandoned"] == before["abandoned"] + 1 and now["busy"] == 0


def test_a_client_that_leaves_mid_stream_stops_its_generation(server, client):
    def leave():
        stream = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=300, seed=1, stream=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()

    stops_early(server, leave)


def test_a_client_that_gives_up_waiting_stops_its_generation(server, client):
    def leave():
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=1.0).chat.completions.create(
                model=MODEL, messages=STORY, max_tokens=300, seed=1
            )

    stops_early(server, leave)


@pytest.mark.parametrize(
    "request_body, status, needle",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b"[" * 100_000, 400, "nested too deeply"),
        (json.dumps({"model": MODEL, "messages": CAPITAL, "n": 2}).encode(), 400, "'n' is not supported"),
        (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "non-empty list"),
        (json.dumps({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}).encode(), 400, "role 'tool'"),
        (json.dumps({"model": MODEL, "messages": CAPITAL * (MESSAGES_LIMIT + 1)}).encode(), 400, "65 messages"),
        (json.dumps({"model": MODEL, "messages": CAPITAL, "temperature": "hot"}).encode(), 400, "'temperature'"),
        (json.dumps({"model": MODEL, "messages": CAPITAL, "pad": "x" * BODY_LIMIT}).encode(), 413, "body is over"),
    ],
    ids=["invalid", "array", "deep", "n", "empty", "role", "messages", "temperature", "body size"],
)
def test_malformed_requests_get_a_4xx_with_an_openai_error(server, request_body, status, needle):
    code, body = post(server, "/chat/completions", request_body)
    assert code == status
    assert needle in body["error"]["message"] and body["error"]["type"] == "invalid_request_error"
    assert "\n" not in body["error"]["message"]


def test_bad_requests_are_refused_and_the_server_goes_on(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CAPITAL)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="'max_tokens' must be from 1"):
        client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="'max_tokens' must be from 1 to the model's context of 512"):
        client.chat.completions.create(model=MODEL, messages=CAPITAL, max_tokens=513)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Paris " * 600}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Paris " * 600)
    assert e.value.body["code"] == "context_length_exceeded"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError, match="text-only: it cannot take images"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}]
        )
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=MODEL, input="Paris")
    reply = client.chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0, max_tokens=24)
    assert "Paris" in reply.choices[0].message.content
