"""Programs against the eager model: logits and greedy generations, every mode and target."""

import dataclasses

import pytest
import torch
from conftest import TINY_MAX_SEQ, TINY_PREFILL, TINY_VOCAB

from genai_pipeline.cli import main
from genai_pipeline.errors import InputError
from genai_pipeline.manifest import Manifest
from genai_pipeline.options import PrepareOptions, QuantOptions, SamplingOptions
from genai_pipeline.runtime.generate import Sampler, generate
from genai_pipeline.runtime.session import DecoderSession, EagerSession

PROMPT = torch.randint(1, TINY_VOCAB, (19,), generator=torch.Generator().manual_seed(3)).tolist()  # not a multiple of 8
CASES = [("hybrid", "xnnpack"), ("hybrid", "portable"), ("dynamic", "xnnpack"), ("dynamic", "portable")]


@pytest.mark.parametrize("mode,target", CASES)
def test_program_logits_match_eager(export_tiny, tiny_eager, mode, target):
    program = DecoderSession(export_tiny(mode, target))
    eager = EagerSession(tiny_eager())
    got, want = program.prefill(PROMPT), eager.prefill(PROMPT)
    assert (got - want).abs().max().item() <= 1e-3
    for token in PROMPT[:8]:  # 8 decode steps
        got, want = program.step(token), eager.step(token)
        assert (got - want).abs().max().item() <= 1e-3


@pytest.mark.parametrize("mode,target", CASES)
def test_greedy_generation_matches_eager(export_tiny, tiny_eager, mode, target):
    greedy = Sampler(SamplingOptions(temperature=0))
    ours = generate(DecoderSession(export_tiny(mode, target)), PROMPT, 32, greedy)
    eager = generate(EagerSession(tiny_eager()), PROMPT, 32, greedy)
    assert len(ours.tokens) == 32
    assert ours.tokens == eager.tokens


@pytest.mark.parametrize("mode", ["hybrid", "dynamic"])
def test_score_gives_every_position(export_tiny, tiny_eager, mode):
    """Programs return the last position's logits; score() still gives each row, against the eager model."""
    program = DecoderSession(export_tiny(mode))
    chunk = PROMPT[: TINY_PREFILL + 3]
    rows = program.score(chunk)
    with torch.no_grad():
        want = tiny_eager()(torch.tensor([chunk]), torch.tensor([0]))[0]
    assert rows.shape == (len(chunk), TINY_VOCAB)
    assert (rows - want).abs().max().item() <= 1e-3


@pytest.mark.parametrize("length", [1, 7, 8, 9, 17])
def test_logits_do_not_depend_on_chunking(export_tiny, tiny_eager, length):
    """Padded last chunks are exact: hybrid without `prefill` (chunks of 8, the last padded)
    and kv (one token at a time) agree with the eager model."""
    prompt = PROMPT[:length]
    want = EagerSession(tiny_eager()).prefill(prompt)
    for folder in (export_tiny("hybrid", long_prefill_len=0), export_tiny("kv")):
        session = DecoderSession(folder)
        assert session.long_prefill_len == 0
        got = session.prefill(prompt)
        assert (got - want).abs().max().item() <= 1e-3, folder


@pytest.mark.parametrize("length", [1, 5, 32, 69])
def test_prompts_go_through_prefill_in_chunks_of_any_length(export_tiny, tiny_eager, length):
    """`prefill` takes 1 to N tokens (N = 4 x --prefill-len): no padding, no token fed twice."""
    program = DecoderSession(export_tiny("hybrid"))
    assert program.long_prefill_len == 4 * TINY_PREFILL  # prepare.LONG_PREFILL_CHUNKS
    prompt = (PROMPT * 4)[:length]
    calls, run = [], program._run
    program._run = lambda graph, tokens: calls.append((graph.value, len(tokens))) or run(graph, tokens)
    got, want = program.prefill(prompt), EagerSession(tiny_eager()).prefill(prompt)
    assert (got - want).abs().max().item() <= 1e-3
    n = program.long_prefill_len
    assert calls == [("prefill", min(n, length - i)) for i in range(0, length, n)]
    assert program.pos == length


def test_the_long_prefill_length_defaults_where_it_fits_and_is_checked(tmp_path):
    assert PrepareOptions().long_prefill == 128 and PrepareOptions(max_seq_len=100).long_prefill == 0
    assert PrepareOptions(mode="dynamic").long_prefill == PrepareOptions(cache_io=True).long_prefill == 0
    assert PrepareOptions(long_prefill_len=0).long_prefill == 0
    assert dataclasses.replace(PrepareOptions(), mode="dynamic").long_prefill == 0  # the default follows the mode
    for bad in (dict(long_prefill_len=32), dict(long_prefill_len=1024), dict(mode="kv", long_prefill_len=64)):
        with pytest.raises(InputError, match="--long-prefill-len"):
            PrepareOptions(**bad)
    assert main(["export", "reference-vlm", "--long-prefill-len", "128", "--out", str(tmp_path / "vlm")]) == 2


def test_decode_continues_from_the_cache_prefill_wrote(export_tiny, tiny_eager):
    folder = export_tiny("hybrid")
    session = DecoderSession(folder)
    session.prefill(PROMPT[:16])  # prefill fills cache rows 0..15
    after_prefill = session.step(PROMPT[16])  # decode_token at position 16
    want = EagerSession(tiny_eager()).prefill(PROMPT[:17])
    assert (after_prefill - want).abs().max().item() <= 1e-3
    # The same decode_token call on a freshly loaded program (empty cache) gives something else.
    fresh = DecoderSession(folder)
    fresh.pos = 16
    assert (fresh.step(PROMPT[16]) - want).abs().max().item() > 1e-2


def test_manifest_describes_the_program(export_tiny, tiny_checkpoint):
    m = Manifest.read(export_tiny("hybrid"))
    assert m.mode == "hybrid" and m.target == "xnnpack" and m.recipe == "fp32"
    assert m.artifacts["text_decoder"].methods == ("prefill_chunk", "decode_token", "prefill")
    assert m.weights == str(tiny_checkpoint)
    # the checkpoint's files, and the entry's chat template standing in for the one it lacks
    assert set(m.files) == {"text_decoder.pte", "tokenizer.json", "generation_config.json", "chat_template.jinja"}
    assert {"torch", "executorch", "torchao", "genai_pipeline"} <= set(m.versions)
    from genai_pipeline.export_folder import sha256

    assert m.files["text_decoder.pte"].sha256 == sha256(export_tiny("hybrid") / "text_decoder.pte")


def test_lowering_from_weights_moved_to_a_file_gives_the_same_program(tiny_checkpoint, tmp_path, monkeypatch):
    """`genai export` quantizes into memory-mapped files (streaming.quantize_blocks) and lowers from
    weights moved to one (compile.map_weights_to_file): byte for byte the program made in memory."""
    import genai_pipeline.compile as compile_module
    from genai_pipeline.prepare import prepare
    from genai_pipeline.quantize import quantize
    from genai_pipeline.registry import get_spec
    from genai_pipeline.targets import get_target

    moved = []
    map_weights_to_file = compile_module.map_weights_to_file
    monkeypatch.setattr(compile_module, "map_weights_to_file", lambda *a: moved.append(map_weights_to_file(*a)))
    target = get_target("xnnpack")
    options = PrepareOptions(mode="kv", max_seq_len=TINY_MAX_SEQ, checkpoint=tiny_checkpoint)  # one method: cheaper
    programs = {}
    for release in (False, True):
        out = tmp_path / f"release-{release}"
        out.mkdir()
        prepared = prepare(get_spec("smollm2-135m"), options)
        prepared = quantize(prepared, QuantOptions(recipe="8da4w"), target, weights_folder=out if release else None)
        artifacts = compile_module.compile_artifacts(prepared, target, out, release=release)
        programs[release] = [p.read_bytes() for p in artifacts.programs.values()]
        assert len(moved) == release
    assert moved[0] > 0
    assert programs[True] == programs[False]
