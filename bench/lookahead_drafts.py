"""Lookahead's drafting choices, replayed on a program's own greedy texts and its measured call costs.

Whether a drafting rule pays depends on the text (how much of it repeats the context) and on the CPU
(what a verify call of n rows costs against a decode step). Timing each rule on the model takes minutes
a text and is noisy; but the generation loop's decisions depend only on the tokens and on those costs.
So, per program:

1. the cost of a call by its length, in decode steps: `step` and `verify` of 2..N tokens at position
   --position, interleaved, medians (what `DraftSizer` will measure for itself at run time);
2. per prompt (a user message through the chat template), plain greedy decoding's tokens;
3. per variant, the shipped loop (`runtime/generate.py`: `NgramDrafter`, `DraftSizer`) over those tokens,
   its sampler replaying them, the program replaced by a stand-in that advances a virtual clock by each
   call's measured cost: the speedup over plain decoding (one step a token) and tokens a call.

Variants: each --max-ngram value with the drafts sized (the shipped rule) and, with --whole, the whole
draft checked every call. A choice made here is confirmed in real time with `genai bench --lookahead`.

    .venv/bin/python -m bench.lookahead_drafts PROGRAM... [--prompts FILE...] [--gen-len 200]
        [--max-ngram 3 16] [--whole] [--threads 2] [--costs EARLIER.json] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as genai run / genai bench (docs/decisions/0002)

import torch  # noqa: E402

from genai_pipeline.bench.text import bench_prompt, replay_sampler  # noqa: E402
from genai_pipeline.options import BenchOptions  # noqa: E402
from genai_pipeline.runtime import generate as loop  # noqa: E402
from genai_pipeline.runtime.lookahead import DraftSizer, LookaheadOptions  # noqa: E402
from genai_pipeline.runtime.program import set_threads  # noqa: E402
from genai_pipeline.runtime.session import DecoderSession  # noqa: E402

PROMPTS = sorted((Path(__file__).parent / "prompts").glob("*.txt"))


def call_costs(session: DecoderSession, position: int, rounds: int = 18) -> dict[int, float]:
    """Tokens in a call (1: a decode step; k > 1: a verify call of the last token and k - 1 drafts, as
    `generate` makes them) -> its median time over a step's, at `position`. The order rotates every
    round: in a fixed one the step, always right after the longest verify, measured 12 % slower than
    a 1-token verify, which alternating the two showed to cost the same."""
    session.reset()
    session.prefill(torch.randint(1, 1000, (position,), generator=torch.Generator().manual_seed(0)).tolist())
    times: dict[int, list[float]] = {k: [] for k in [1, *range(2, session.verify_len + 1)]}
    order = list(times)
    for r in range(rounds):
        for k in order[r % len(order) :] + order[: r % len(order)]:
            session.pos = position
            start = time.perf_counter()
            session.step(7) if k == 1 else session.verify([7] * k)
            times[k].append(time.perf_counter() - start)
    step = statistics.median(times[1])
    return {k: round(statistics.median(t) / step, 3) for k, t in times.items()}


class CostedReplay:
    """The program's stand-in: every call advances the clock by what that call costs the program
    (`costs`: tokens in a verify call -> decode steps); the logits are placeholders, since the
    sampler replays recorded tokens."""

    def __init__(self, session: DecoderSession, costs: dict[int, float], clock: SimpleNamespace):
        self.costs, self.clock, self.pos = costs, clock, 0
        self.max_seq_len, self.verify_len, self.verify_rows = (
            session.max_seq_len,
            session.verify_len,
            session.verify_rows,
        )

    def prefill(self, tokens: list[int]) -> torch.Tensor:
        self.pos += len(tokens)
        return torch.zeros(1)

    def step(self, token: int) -> torch.Tensor:
        self.pos += 1
        self.clock.now += 1.0
        return torch.zeros(1)

    can_verify = DecoderSession.can_verify  # the session's rules, over this stand-in's cursor
    rewind = DecoderSession.rewind

    def verify(self, tokens: list[int]) -> torch.Tensor:
        self.pos += len(tokens)
        self.clock.now += self.costs[len(tokens)]
        return torch.zeros(len(tokens), 1)


def replayed(session, costs, prompt, stop_ids, plain, options: LookaheadOptions, whole: bool):
    clock = SimpleNamespace(now=0.0)
    with ExitStack() as patches:
        patches.enter_context(mock.patch.object(loop, "time", SimpleNamespace(perf_counter=lambda: clock.now)))
        if whole:
            patches.enter_context(mock.patch.object(DraftSizer, "size", lambda self, drafted, rows_of: drafted))
        result = loop.generate(
            CostedReplay(session, costs, clock),
            prompt,
            len(plain.tokens),
            replay_sampler(plain, stop_ids),
            stop_ids,
            lookahead=options,
        )
    assert result.tokens == plain.tokens
    steps = len(result.tokens) - 1
    return {
        "speedup": round(steps / result.decode_seconds, 3) if steps else 1.0,
        "tokens_per_call": round(result.tokens_per_call, 2),
        "verify_calls": result.verify_calls,
    }


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.lookahead_drafts", description=__doc__.split("\n")[0])
    p.add_argument("programs", nargs="+", type=Path)
    p.add_argument("--prompts", nargs="+", type=Path, default=PROMPTS)
    p.add_argument("--gen-len", type=int, default=200)
    p.add_argument("--max-ngram", nargs="+", type=int, default=[3, LookaheadOptions().max_ngram])
    p.add_argument("--whole", action="store_true", help="also check whole drafts every call (no sizing)")
    p.add_argument("--position", type=int, default=300, help="where the call costs are measured")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--costs",
        type=Path,
        help="an earlier run's JSON: its measured costs, not new ones (the replay is "
        "then deterministic: code versions compare on the same costs)",
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    set_threads(args.threads)
    variants = [(m, whole) for m in args.max_ngram for whole in ((False, True) if args.whole else (False,))]
    names = [f"n{m}{' whole' if whole else ''}" for m, whole in variants]
    report = {"position": args.position, "threads": args.threads, "gen_len": args.gen_len, "programs": {}}
    earlier = json.loads(args.costs.read_text())["programs"] if args.costs else {}
    for folder in args.programs:
        session = DecoderSession(folder)
        if not session.verify_len:
            sys.exit(f"{folder} has no `verify` method: export it with --verify-len N")
        if folder.name in earlier:
            costs = {int(k): c for k, c in earlier[folder.name]["costs_in_steps"].items()}
        else:
            costs = call_costs(session, args.position)
        print(
            f"{folder.name}: a call of k tokens costs (decode steps) "
            + ", ".join(f"{k}: {c:.2f}" for k, c in costs.items()),
            flush=True,
        )
        options = [LookaheadOptions(draft_len=session.verify_len - 1, max_ngram=m) for m, _ in variants]
        rows = {}
        for file in args.prompts:
            prompt, stop_ids = bench_prompt(folder, session, BenchOptions(prompt_file=file, chat=True))
            session.reset()
            plain = loop.generate(session, prompt, args.gen_len, loop.greedy_token, stop_ids)
            rows[file.stem] = {
                "tokens": len(plain.tokens),
                **{
                    name: replayed(session, costs, prompt, stop_ids, plain, o, whole)
                    for name, o, (_, whole) in zip(names, options, variants)
                },
            }
            print(
                f"  {file.stem:20s} {len(plain.tokens):4d} tokens  "
                + "  ".join(
                    f"{n} {rows[file.stem][n]['speedup']:.2f}x ({rows[file.stem][n]['tokens_per_call']:.2f} a call)"
                    for n in names
                ),
                flush=True,
            )
        geomean = {n: round(statistics.geometric_mean(r[n]["speedup"] for r in rows.values()), 3) for n in names}
        print(f"  {'geometric mean':20s}       " + "  ".join(f"{n} {g:.2f}x" for n, g in geomean.items()), flush=True)
        report["programs"][folder.name] = {"costs_in_steps": costs, "prompts": rows, "geomean_speedup": geomean}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
