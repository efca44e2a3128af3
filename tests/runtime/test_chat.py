"""Multi-turn chat: each turn prefills only what the cache lacks, and replies as a fresh prefill would."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REFERENCE, TINY_MAX_SEQ, TINY_PREFILL, TINY_VOCAB

from genai_pipeline.chat_template import ChatTemplate, read_chat_template, render_chat
from genai_pipeline.checkpoints.hf import load_decoder
from genai_pipeline.compile import compile_artifacts
from genai_pipeline.errors import ChatTemplateError, ContextFullError, ExportError
from genai_pipeline.messages import ContentPart, Message
from genai_pipeline.options import PrepareOptions, SamplingOptions
from genai_pipeline.prepare import prepare
from genai_pipeline.registry import get_spec
from genai_pipeline.runtime.chat import Chat, Reply, drop_oldest_turns, end_of_turn_ids
from genai_pipeline.runtime.generate import Sampler, generate
from genai_pipeline.runtime.session import DecoderSession, EagerSession
from genai_pipeline.targets import Target
from genai_pipeline.tokenizer import Tokenizer

# ChatML with the tiny tokenizer's only special token, <|endoftext|>, opening the chat and ending each turn.
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant\\n' }}{% endif %}"
)
SPECIALS = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
CHATML = ChatTemplate(TEMPLATE, **SPECIALS)
TURNS = ("What is a list?", "And a tuple?", "Thanks.")
GREEDY = SamplingOptions()
MAX_NEW = 6


@pytest.fixture(scope="module")
def program(export_tiny):
    """The hybrid program: prefill chunks of TINY_PREFILL tokens, so a turn starts anywhere in a chunk."""
    return DecoderSession(export_tiny("hybrid"))


@pytest.fixture(scope="module")
def tokenizer(export_tiny):
    return Tokenizer(export_tiny("hybrid") / "tokenizer.json")


@pytest.fixture
def eager(tiny_eager):
    return EagerSession(tiny_eager(), TINY_MAX_SEQ)


class Recording:
    """A session that mirrors what its cache holds (positions past the cursor are dead) and logs
    each prefill as (what the cache held before it, what was fed)."""

    def __init__(self, session):
        self.session = session
        self.max_seq_len = session.max_seq_len
        self.cache: list[int] = []
        self.prefills: list[tuple[list[int], list[int]]] = []

    @property
    def pos(self):
        return self.session.pos

    def reset(self):
        self.session.reset()

    def rewind(self, pos):
        self.session.rewind(pos)

    def _write(self, tokens):
        self.cache[self.pos :] = tokens

    def prefill(self, tokens):
        self.prefills.append((self.cache[: self.pos], list(tokens)))
        self._write(tokens)
        return self.session.prefill(tokens)

    def step(self, token):
        self._write([token])
        return self.session.step(token)


def rendered_ids(tokenizer, messages):
    text = render_chat(tuple(messages), TEMPLATE, **SPECIALS, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def new_chat(session, tokenizer, stop_ids=(0,), max_new=MAX_NEW, **kwargs):
    return Chat(session, tokenizer, CHATML, Sampler(GREEDY), stop_ids, max_new, **kwargs)


def common_prefix(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclasses.dataclass(frozen=True)
class ChatModel:
    session: object
    tokenizer: Tokenizer
    max_new: int
    # The tiny program's random weights reply bytes that are not UTF-8: their text encodes to
    # other tokens, so a turn is prefilled again from the reply on. A trained model replies text.
    replies_text: bool


@pytest.fixture(params=["program", "reference"])
def model(request):
    if request.param == "program":
        return ChatModel(request.getfixturevalue("program"), request.getfixturevalue("tokenizer"), MAX_NEW, False)
    # the shipped model, eager; 12 new tokens, or its greedy replies repeat from turn to turn
    reference = EagerSession(load_decoder(get_spec("reference"), REFERENCE, 256))
    return ChatModel(reference, Tokenizer(REFERENCE / "tokenizer.json"), 12, True)


def test_turns_prefill_only_what_the_cache_lacks_and_reply_as_a_fresh_prefill(model):
    session, tokenizer, max_new = model.session, model.tokenizer, model.max_new
    recording = Recording(session)
    chat = new_chat(recording, tokenizer, max_new=max_new)
    replies, last_ids = [], []
    for text in TURNS:
        before = list(recording.cache)
        reply = chat.send(text)
        ids = rendered_ids(tokenizer, chat.messages[:-1])
        kept, fed = recording.prefills[-1]
        assert kept + fed == ids  # the cache then holds exactly the rendered conversation
        assert len(kept) == min(common_prefix(before, ids), len(ids) - 1)  # nothing it held was fed again
        assert len(kept) >= len(last_ids) and (len(kept), len(fed)) == (reply.reused, reply.prefilled)
        if model.replies_text and replies:  # the last reply's tokens stayed, all but the unfed last one
            assert replies[-1].stop_reason == "length" and len(kept) == len(last_ids) + len(replies[-1].tokens) - 1
        replies.append(reply)
        last_ids = ids

    # Oracle: every turn prefilled from an empty cache; greedy, so the replies must agree.
    messages = []
    for text, reply in zip(TURNS, replies):
        messages.append(Message("user", text))
        session.reset()
        fresh = generate(session, rendered_ids(tokenizer, messages), max_new, Sampler(GREEDY), (0,))
        assert tuple(fresh.tokens) == reply.tokens
        messages.append(Message("assistant", tokenizer.decode(fresh.tokens)))
    assert len({r.tokens for r in replies}) > 1  # the model answers differently to different turns


class Scripted:
    """A model that answers `script` token by token whatever it is fed."""

    def __init__(self, script, vocab_size=TINY_VOCAB, max_seq_len=TINY_MAX_SEQ):
        self.script, self.vocab_size, self.max_seq_len = script, vocab_size, max_seq_len
        self.pos, self.next = 0, 0

    def reset(self):
        self.pos = 0

    def rewind(self, pos):
        self.pos = pos

    def _logits(self):
        logits = torch.zeros(self.vocab_size)
        logits[self.script[min(self.next, len(self.script) - 1)]] = 1.0
        self.next += 1
        return logits

    def prefill(self, tokens):
        self.pos += len(tokens)
        self.next = 0
        return self._logits()

    def step(self, token):
        self.pos += 1
        return self._logits()


def test_an_end_of_turn_token_ends_the_reply_and_is_fed_with_the_next_turn(tokenizer):
    answer = tokenizer.encode("It is a list.", add_special_tokens=False)
    recording = Recording(Scripted(answer + [0, 7, 7]))
    chat = new_chat(recording, tokenizer, stop_ids=(0,), max_new=20)
    reply = chat.send(TURNS[0])
    assert reply == Reply("It is a list.", tuple(answer), "eos", reused=0, prefilled=reply.prefilled)
    ids = rendered_ids(tokenizer, [Message("user", TURNS[0])])
    assert recording.cache == ids + answer  # the end-of-turn token was sampled, never fed
    chat.send(TURNS[1])
    kept, fed = recording.prefills[-1]
    assert kept == ids + answer and fed[0] == 0  # the reply stayed; the turn's end comes first


def test_end_of_turn_ids_come_from_manifest_generation_config_and_vocabulary(tmp_path, export_tiny):
    from tokenizers import Tokenizer as HFTokenizer

    folder = export_tiny("hybrid")
    plain = Tokenizer(folder / "tokenizer.json")
    # the tiny checkpoint's generation_config.json says 0; <|endoftext|> is 0; <|im_end|> is not one token
    assert end_of_turn_ids(folder, plain, [], ChatTemplate(TEMPLATE)) == (0,)

    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    hf.add_special_tokens(["<|im_end|>", "<|custom_end|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    extended = Tokenizer(tmp_path / "tokenizer.json")
    im_end, custom = (extended.encode(t, add_special_tokens=False)[0] for t in ("<|im_end|>", "<|custom_end|>"))
    stop = end_of_turn_ids(tmp_path, extended, [3], ChatTemplate(TEMPLATE, eos_token="<|custom_end|>"))
    assert stop == tuple(sorted({0, 3, 7, 9, im_end, custom}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert 5 in end_of_turn_ids(tmp_path, extended, [], ChatTemplate(TEMPLATE))


def test_reset_forgets_the_conversation_but_keeps_the_system_message(eager, tokenizer):
    chat = new_chat(eager, tokenizer, system="Be brief.")
    first = chat.send(TURNS[0])
    chat.send(TURNS[1])
    chat.reset()
    assert chat.messages == (Message("system", "Be brief."),) and eager.pos == 0
    again = chat.send(TURNS[0])
    assert again.reused == 0 and again.tokens == first.tokens


def test_a_message_that_alone_does_not_fit_leaves_the_conversation_as_it_was(tiny_eager, tokenizer):
    session = EagerSession(tiny_eager(), 40)
    chat = new_chat(session, tokenizer, stop_ids=())
    chat.send("Hi")
    before = (chat.messages, list(chat.cached), session.pos)
    with pytest.raises(ContextFullError, match="context is 40"):
        chat.send("word " * 60)
    assert (chat.messages, chat.cached, session.pos) == before
    assert chat.send("Ok").reused > 0  # the conversation goes on
    ids = rendered_ids(tokenizer, [Message("user", "Hi")])
    squeezed = new_chat(EagerSession(tiny_eager(), len(ids) + 2), tokenizer, stop_ids=(), max_new=10).send("Hi")
    assert squeezed.stop_reason == "context" and len(squeezed.tokens) == 3  # nothing older to drop


def test_the_oldest_whole_turns_go_first_with_their_images():
    def user(text, *images):
        return Message("user", (*(ContentPart("image", image=Path(i)) for i in images), ContentPart("text", text=text)))

    messages = (
        Message("system", "S"),
        user("u0", "0.png"),
        Message("assistant", "a0"),
        user("u1"),
        Message("assistant", "a1"),
        Message("assistant", "a1, more"),  # a turn runs to the next user message
        user("u2", "2a.png", "2b.png"),
        Message("assistant", "a2"),
        user("now"),
    )
    frames = ("frame-0", "frame-2a", "frame-2b")  # one per image part, in order
    kept, images, dropped = drop_oldest_turns(messages, frames, 1, lambda m, i: len(m) <= 4)
    assert [m.text for m in kept] == ["S", "u2", "a2", "now"] and images == ("frame-2a", "frame-2b") and dropped == 2
    kept, images, dropped = drop_oldest_turns(messages, frames, 1, lambda m, i: False)
    assert [m.text for m in kept] == ["S", "now"] and images == () and dropped == 3
    assert drop_oldest_turns(messages, frames, 1, lambda m, i: True) == (messages, frames, 0)


def test_a_conversation_longer_than_the_context_goes_on_from_its_latest_turns(tiny_eager, tokenizer):
    """Every turn replies, the system message stays first, and a turn after a drop replies exactly as
    a fresh session given the kept conversation would (the cache holds what the drop left)."""
    context = 64
    chat = new_chat(EagerSession(tiny_eager(), context), tokenizer, stop_ids=(), max_new=8, system="Be brief.")
    drops = 0
    for k in range(12):
        before = chat.messages
        reply = chat.send(f"question {k}?")
        assert reply.tokens and reply.stop_reason == "length" and len(reply.tokens) == 8
        drops += reply.dropped
        assert chat.messages[0] == Message("system", "Be brief.")
        kept = chat.messages[:-1]  # the conversation the reply was generated from
        if reply.dropped:
            assert len(kept) < len(before) + 1
            fresh = new_chat(EagerSession(tiny_eager(), context), tokenizer, stop_ids=(), max_new=8)
            fresh.messages = kept[:-1]
            assert fresh.send(kept[-1].content).tokens == reply.tokens
        assert len(rendered_ids(tokenizer, chat.messages)) <= context
    assert drops >= 3


def test_a_reply_that_fills_the_context_drops_older_turns_and_goes_on(tiny_eager, tokenizer):
    session = Recording(EagerSession(tiny_eager(), TINY_MAX_SEQ))
    chat = new_chat(session, tokenizer, stop_ids=(), max_new=2)  # short turns: one fits beside the room for a reply
    for k in range(3):
        chat.send(f"question {k}?")
    chat.max_new_tokens = 70  # more than the room kept for a reply (half the context)
    session.prefills.clear()
    reply = chat.send("tell me more")
    assert len(reply.tokens) == 70 and reply.stop_reason == "length" and reply.dropped >= 1
    # after the drop, the kept conversation and the reply so far were fed again, and generation went on
    assert len(session.prefills) == 2
    kept, (held, fed) = rendered_ids(tokenizer, chat.messages[:-1]), session.prefills[1]
    fed_again = held + fed  # what the cache held, then what was fed
    assert fed_again[: len(kept)] == kept and 0 < len(fed_again) - len(kept) < 70
    assert fed_again[len(kept) :] == list(reply.tokens[: len(fed_again) - len(kept)])


def test_a_template_that_fails_to_render_names_its_file(eager, tokenizer, tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(SPECIALS))
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + TEMPLATE
    )
    template = read_chat_template(tmp_path)
    chat = Chat(eager, tokenizer, template, Sampler(GREEDY), (0,), MAX_NEW, system="Be brief.")
    with pytest.raises(
        ChatTemplateError, match=r"chat_template.jinja': the chat template fails: System role not supported"
    ):
        chat.send("Hi")
    assert Chat(eager, tokenizer, template, Sampler(GREEDY), (0,), MAX_NEW).send("Hi").tokens


def test_export_writes_the_registry_template_when_the_checkpoint_has_none(tmp_path, tiny_checkpoint):
    """A target that never lowers: compile still writes the runtime files and the manifest."""
    options = PrepareOptions(max_seq_len=TINY_MAX_SEQ, prefill_len=TINY_PREFILL, checkpoint=tiny_checkpoint)
    prepared = prepare(get_spec("smollm2-135m"), options)
    prepared = dataclasses.replace(prepared, spec=dataclasses.replace(prepared.spec, chat_template=TEMPLATE))
    target = Target(
        name="none", description="", recipes=("fp32",), partitioners=list, lowering_blocked=lambda: "not here"
    )
    with pytest.raises(ExportError, match="not here"):
        compile_artifacts(prepared, target, tmp_path / "out")
    assert read_chat_template(tmp_path / "out").source == TEMPLATE
    assert "chat_template.jinja" in json.loads((tmp_path / "out" / "manifest.json").read_text())["files"]

    checkpoint = shutil.copytree(tiny_checkpoint, tmp_path / "own")  # a checkpoint with its own template keeps it
    (checkpoint / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    prepared = dataclasses.replace(prepared, tokenizer_file=checkpoint / "tokenizer.json")
    with pytest.raises(ExportError):
        compile_artifacts(prepared, target, tmp_path / "out2")
    assert read_chat_template(tmp_path / "out2").source == "{{ messages[0]['content'] }}"
