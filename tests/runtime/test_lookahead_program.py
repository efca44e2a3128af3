"""Lookahead decoding through exported programs: greedy output identical to plain decoding, token
for token, across prefill-chunk boundaries and up to the end of the context."""

from pathlib import Path

import pytest
import torch
from conftest import Q4, REFERENCE

import genai_pipeline
from genai_pipeline.cli import main
from genai_pipeline.errors import InputError
from genai_pipeline.options import PrepareOptions, QuantOptions
from genai_pipeline.quantize.recipes import describe
from genai_pipeline.runtime.generate import generate, greedy_token
from genai_pipeline.runtime.lookahead import LookaheadOptions
from genai_pipeline.runtime.session import DecoderSession
from genai_pipeline.tokenizer import Tokenizer

VERIFY_LEN = 8
REFERENCE_MAX_SEQ = 256


@pytest.fixture(scope="session")
def export_reference_verify(tmp_path_factory):
    """export_reference_verify(mode, quant=QuantOptions()) -> folder of the reference model with a
    `verify` method of up to VERIFY_LEN tokens."""
    built: dict[tuple, Path] = {}

    def build(mode: str, quant: QuantOptions = QuantOptions()) -> Path:
        if (mode, quant) not in built:
            out = tmp_path_factory.mktemp(f"reference_verify_{mode}_{describe(quant)}")
            options = PrepareOptions(
                mode=mode, max_seq_len=REFERENCE_MAX_SEQ, prefill_len=32, verify_len=VERIFY_LEN, long_prefill_len=0
            )
            genai_pipeline.export("reference", out=out, prepare=options, quant=quant, verify=False)
            built[mode, quant] = out
        return built[mode, quant]

    return build


def assert_lookahead_is_lossless(
    folder: Path,
    prompts: list[str],
    max_new_tokens: int | None = None,
    draft_len: int = VERIFY_LEN - 1,
    near_tie: float = 0.0,
    chat: bool = False,
) -> list:
    """Greedy generation from each prompt, plain and with lookahead, in one session: the same
    tokens, and the cache cursor where plain decoding leaves it. `max_new_tokens` None: up to the
    end of the context. `chat`: each prompt is a user message through the folder's chat template,
    generation stops at an end-of-turn token.

    `near_tie` > 0 (8da4w programs of real models, docs/decisions/0010: verify and decode round
    differently, dynamic activation quantization amplifies it): where the texts part, the token
    lookahead chose must be within `near_tie` of the best logit plain decoding saw there, i.e. a
    near-tie, not a wrong cache row. Returns the lookahead generations (for their call counts)."""
    session = DecoderSession(Path(folder))
    tokenizer = Tokenizer.from_folder(Path(folder), bos_id=session.manifest.get("bos_id"))
    eos = tuple(session.manifest.get("eos_ids", ()))
    results = []
    for text in prompts:
        if chat:
            from genai_pipeline.bench.text import bench_prompt
            from genai_pipeline.options import BenchOptions

            file = Path(folder) / ".lookahead_prompt.txt"  # bench_prompt reads a file, as genai bench does
            file.write_text(text, encoding="utf-8")
            prompt, eos = bench_prompt(Path(folder), session, BenchOptions(prompt_file=file, chat=True))
            file.unlink()
        else:
            prompt = tokenizer.encode(text)
        room = session.max_seq_len - len(prompt) + 1  # the last generated token is never fed
        n = min(max_new_tokens or room, room)
        runs = []
        for options in (LookaheadOptions(), LookaheadOptions(draft_len=draft_len)):
            session.reset()
            runs.append(generate(session, prompt, n, greedy_token, eos, lookahead=options))
            runs[-1].pos = session.pos
        plain, ahead = runs
        if near_tie and ahead.tokens != plain.tokens:
            i = next(k for k, (p, a) in enumerate(zip(plain.tokens + [None], ahead.tokens + [None])) if p != a)
            session.reset()
            logits = session.prefill(prompt)
            for token in plain.tokens[:i]:
                logits = session.step(token)
            chosen = ahead.tokens[i] if i < len(ahead.tokens) else eos[0]
            assert logits.max() - logits[chosen] <= near_tie, f"lookahead chose {chosen} at {i}, not a near-tie"
            results.append(ahead)
            continue
        assert ahead.tokens == plain.tokens, f"lookahead changed the greedy output of {text[:40]!r}"
        assert ahead.pos == plain.pos
        results.append(ahead)
    return results


def heldout_prompts() -> list[str]:
    # Documentation prose repeats its own phrases: drafts are found and often kept.
    text = (REFERENCE / "heldout.txt").read_text(encoding="utf-8")
    return [text[:200], text[1000:1700], "The return value of the function is the return value"]


@pytest.mark.parametrize("mode, quant", [("hybrid", Q4), ("dynamic", Q4), ("hybrid", None)])
def test_greedy_lookahead_equals_plain_decoding_to_the_context_edge(export_reference_verify, mode, quant):
    folder = export_reference_verify(mode, *([quant] if quant else []))
    results = assert_lookahead_is_lossless(folder, heldout_prompts())
    # The prompts end mid-chunk, and generation runs to the end of the context.
    assert all(len(r.prompt_tokens) % 32 for r in results)
    assert all(
        len(r.prompt_tokens) + len(r.tokens) == REFERENCE_MAX_SEQ + 1 for r in results if r.stop_reason == "length"
    )
    assert sum(r.accepted for r in results) > 0 and sum(r.verify_calls for r in results) > 0


def test_verify_logits_are_the_decode_steps_logits(export_reference_verify):
    folder = export_reference_verify("hybrid", Q4)
    session = DecoderSession(folder)
    tokens = list(range(40, 40 + 37))
    session.prefill(tokens[:30])
    rows = session.verify(tokens[30:35])
    session.pos = 30
    steps = torch.stack([session.step(t) for t in tokens[30:35]])
    assert rows.shape == steps.shape and torch.allclose(rows, steps, atol=1e-4, rtol=1e-4)


def test_verify_takes_any_length_up_to_its_own_and_never_past_the_context(export_reference_verify):
    session = DecoderSession(export_reference_verify("hybrid", Q4))
    assert session.manifest["artifacts"]["text_decoder"]["dynamic_methods"] == ["verify"]
    assert [session.verify_rows(n) for n in (1, 3, VERIFY_LEN)] == [1, 3, VERIFY_LEN]
    tokens = list(range(40, 40 + 36))
    session.prefill(tokens[:30])
    short = session.verify(tokens[30:33])
    session.pos = 30
    session.verify_padded = True  # how a program exported with a verify of one length is run
    assert session.verify_rows(3) == VERIFY_LEN and torch.allclose(
        session.verify(tokens[30:33]), short, atol=1e-4, rtol=1e-4
    )
    session.verify_padded = False
    session.pos = REFERENCE_MAX_SEQ - 2
    assert session.can_verify(2) and not session.can_verify(3)
    with pytest.raises(InputError, match="verify"):
        session.verify([1, 2, 3])


def test_cli_run_with_lookahead(export_reference_verify, export_reference, capsys):
    import json

    folder = export_reference_verify("hybrid", Q4)
    args = ["run", str(folder), "--prompt", "The return value of the function", "--max-new-tokens", "40", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--lookahead", "7"]) == 0
    ahead = json.loads(capsys.readouterr().out)
    assert ahead["tokens"] == plain["tokens"] and ahead["tokens_per_call"] >= 1 and plain["tokens_per_call"] == 1
    # A program without a verify method says what to do.
    assert main(["run", str(export_reference("hybrid", Q4)), "--prompt", "x", "--lookahead", "4"]) == 2
    assert "--verify-len" in capsys.readouterr().err


def test_bench_reports_lookahead_figures(export_reference_verify, tmp_path, capsys):
    import json

    prompt = tmp_path / "prompt.txt"
    prompt.write_text((REFERENCE / "heldout.txt").read_text(encoding="utf-8")[:600])
    folder = export_reference_verify("dynamic", Q4)
    args = [
        "bench",
        str(folder),
        "--prompt-file",
        str(prompt),
        "--gen-len",
        "48",
        "--repeats",
        "1",
        "--lookahead",
        "7",
        "--json",
    ]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)["lookahead"]
    assert r["draft_len"] == 7 and r["tokens"] == r["plain_tokens"] == 48 and r["tokens_per_call"] >= 1
    assert r["first_difference"] is None  # the reference program's verify rows are its decode steps'
    assert r["decode_tokens_per_s"] > 0 and r["plain_decode_tokens_per_s"] > 0 and r["accepted"] <= r["drafted"]
    assert r["verify_cost_in_steps"] >= 0  # 0 when no plain step or no verify call ran


def test_real_model_lookahead_parts_from_plain_decoding_only_at_near_ties(smollm2_fp32):
    # SmolLM2-135M-Instruct from its GGUF, fp32, --verify-len 8 (tests/conftest.py).
    folder = smollm2_fp32
    paragraph = (REFERENCE / "heldout.txt").read_text(encoding="utf-8")[:600]
    prompts = [
        f"Rewrite the following text so that it is easier to read.\n\n{paragraph}",
        "Write a short story about a robot who learns to paint.",
    ]
    results = assert_lookahead_is_lossless(folder, prompts, max_new_tokens=120, near_tie=1.0, chat=True)
    assert results[0].tokens_per_call > 1.5
