"""The Session protocol (runtime/session.py): every session class has it, built for real; open_session
picks the right class for every kind of export folder; and a session rewound to a shorter prefix
continues exactly as a fresh session fed only that prefix does."""

from __future__ import annotations

import pytest
import torch
from conftest import REFERENCE, TINY_PREFILL

from genai_pipeline.errors import InputError
from genai_pipeline.evaluate.text import float_model
from genai_pipeline.manifest import Manifest
from genai_pipeline.models.cache_io import CacheIOContract, eager_runner
from genai_pipeline.names import GraphName
from genai_pipeline.prepare.cache_io import CacheIOGraph
from genai_pipeline.runtime.cache_io import CacheIOSession
from genai_pipeline.runtime.multimodal import EagerMultimodalSession, MultimodalSession
from genai_pipeline.runtime.open import open_session
from genai_pipeline.runtime.session import DecoderSession, EagerSession, Session
from genai_pipeline.tokenizer import Tokenizer

PREFIX = [5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 120]  # a chunk of 8 and a partial one in a hybrid program
FIRST = [33, 2, 77, 150, 9]  # the continuation the rewind abandons
SECOND = [31, 200, 45, 12, 6, 90, 14]
DEMO_IMAGE = REFERENCE.parent / "reference-vlm" / "demo.ppm"

# the text program folders (export_tiny's arguments) and the class open_session gives each
TEXT_FOLDERS = {
    "hybrid": (("hybrid",), DecoderSession),
    "hybrid, padded prefill chunks": (("hybrid", "xnnpack", False, 0), DecoderSession),
    "kv": (("kv",), DecoderSession),
    "dynamic": (("dynamic",), DecoderSession),
    "cache-I/O": (("hybrid", "portable", True), CacheIOSession),
}
EAGER = ("eager", "eager cache-I/O", "eager vision-language")


@pytest.fixture(scope="module")
def vision_prompt(export_reference_vlm) -> tuple[list[int], list]:
    """A prompt with one image as MultimodalSession.encode_prompt expands it, and the image's frames."""
    session = open_session(export_reference_vlm)
    ids = session.encode_prompt(Tokenizer.from_folder(export_reference_vlm), "What colour is it?", [DEMO_IMAGE])
    return ids, list(session.frames)


@pytest.fixture
def new_session(request, export_tiny, tiny_eager):
    """(make, prefix): make(kind) -> a fresh session of that kind; prefix(session) -> the ids of a
    prompt for it (the text PREFIX, or the vision prompt, whose image it stages)."""

    def make(kind: str) -> Session:
        if kind in TEXT_FOLDERS:
            return open_session(export_tiny(*TEXT_FOLDERS[kind][0]))
        if kind == "vision-language":
            return open_session(request.getfixturevalue("export_reference_vlm"))
        if kind == "eager":
            return EagerSession(tiny_eager())
        if kind == "eager cache-I/O":
            decoder = tiny_eager()
            decoder.use_cache_io()
            graph = CacheIOGraph(decoder)
            contract = CacheIOContract.of(decoder, {"prefill_chunk": TINY_PREFILL, "decode_token": 1})
            graphs = {GraphName.PREFILL_CHUNK: graph, GraphName.DECODE_TOKEN: graph}
            return CacheIOSession(contract, eager_runner(graphs, decoder.config.n_layers))
        assert kind == "eager vision-language"
        folder = request.getfixturevalue("export_reference_vlm")
        manifest = Manifest.read(folder)
        model = float_model(manifest)
        return EagerMultimodalSession(model, manifest.vision["image_token_id"])

    def prefix(session: Session) -> list[int]:
        if not isinstance(session, (MultimodalSession, EagerMultimodalSession)):
            return PREFIX
        ids, frames = request.getfixturevalue("vision_prompt")
        session.frames = list(frames)
        return ids

    return make, prefix


KINDS = [*TEXT_FOLDERS, "vision-language", *EAGER]


@pytest.mark.parametrize("kind", KINDS)
def test_every_session_class_is_a_session(new_session, kind):
    make, _ = new_session
    assert isinstance(make(kind), Session)


def test_what_lacks_a_member_is_no_session(tiny_eager):
    class Steps:  # prefill and step only: enough for plain `generate`, not a Session
        pos, max_seq_len = 0, 8

        def prefill(self, tokens): ...
        def step(self, token): ...

    assert not isinstance(Steps(), Session) and isinstance(EagerSession(tiny_eager()), Session)


@pytest.mark.parametrize("kind", [*TEXT_FOLDERS, "vision-language"])
def test_open_session_picks_the_session_of_each_kind_of_folder(export_tiny, export_reference_vlm, kind):
    if kind == "vision-language":
        folder, expected = export_reference_vlm, MultimodalSession
    else:
        folder, expected = export_tiny(*TEXT_FOLDERS[kind][0]), TEXT_FOLDERS[kind][1]
    assert type(open_session(folder)) is expected


@pytest.mark.parametrize("kind", KINDS)
def test_a_rewound_session_continues_as_a_fresh_one(new_session, kind):
    """Cache rows past the cursor are never read: after a rewind, what was fed past it (a prompt's
    continuation, generated tokens) leaves no trace. Fed in the same calls as a fresh session, the
    logits are the same bits; a prefix fed in one call with the abandoned continuation differs
    only by the float rounding of another call shape."""
    make, prefix = new_session
    fresh, rewound, again = make(kind), make(kind), make(kind)

    ids = prefix(rewound)
    rewound.prefill(ids)
    rewound.prefill(FIRST)
    for token in FIRST[:3]:
        rewound.step(token)
    rewound.rewind(len(ids))
    fresh.prefill(prefix(fresh))
    got = [rewound.prefill(SECOND), *(rewound.step(t) for t in SECOND[:3])]
    want = [fresh.prefill(SECOND), *(fresh.step(t) for t in SECOND[:3])]
    assert rewound.pos == fresh.pos == len(ids) + len(SECOND) + 3
    assert all(torch.equal(g, w) for g, w in zip(got, want))

    # A server's case: the last request's prompt and continuation were fed in one prefill, and the
    # next request shares its prompt.
    ids = prefix(again)
    again.prefill(ids + FIRST)
    again.rewind(len(ids))
    assert torch.allclose(again.prefill(SECOND), want[0], atol=1e-4, rtol=1e-4)

    with pytest.raises(InputError, match="cannot rewind to position"):
        again.rewind(again.pos + 1)
    again.reset()
    assert again.pos == 0
