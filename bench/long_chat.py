"""A chat longer than the context: what dropping the oldest turns costs when the cache fills.

The real SmolLM2-135M-Instruct (its GGUF from `make test`'s .cache) exported fp32, hybrid, with a small
context; a scripted conversation of N turns through `runtime.chat.Chat`, greedy. Per turn: the tokens
prefilled, the turns dropped, the time to the first token of the reply. Prints the medians of the turns
that reused the cache and of the turns that dropped turns (their kept conversation is prefilled again),
and writes JSON with every turn and the host.

    .venv/bin/python -m bench.long_chat [--folder EXPORT] [--turns 40] [--max-seq-len 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import HERE, ROOT, machine

GGUF = ROOT / ".cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "You are a helpful assistant. The password is BLUEBIRD. When asked for the password, say it."
FILLERS = ("Name a fruit.", "What is two plus three?", "Name a colour.", "Say hello in French.", "Name an animal.")


def export(folder: Path, max_seq_len: int) -> None:
    argv = [sys.executable, "-m", "genai_pipeline.cli", "export", "--checkpoint", str(GGUF), "--out", str(folder)]
    subprocess.run([*argv, "--max-seq-len", str(max_seq_len)], check=True, cwd=ROOT)


def converse(folder: Path, turns: int, max_new_tokens: int) -> list[dict]:
    from genai_pipeline.chat_template import read_chat_template
    from genai_pipeline.options import SamplingOptions
    from genai_pipeline.runtime.chat import Chat, end_of_turn_ids
    from genai_pipeline.runtime.generate import Sampler
    from genai_pipeline.runtime.open import open_session
    from genai_pipeline.tokenizer import Tokenizer

    session, tokenizer = open_session(folder), Tokenizer.from_folder(folder)
    template = read_chat_template(folder)
    stop = end_of_turn_ids(folder, tokenizer, session.manifest.get("eos_ids", ()), template)
    chat = Chat(session, tokenizer, template, Sampler(SamplingOptions()), stop, max_new_tokens, system=SYSTEM)
    rows = []
    for k in range(turns):
        text = "What is the password?" if k in (0, turns - 1) else FILLERS[(k - 1) % len(FILLERS)]
        first: list[float] = []
        start = time.perf_counter()
        reply = chat.send(text, on_token=lambda _: first.append(time.perf_counter()) if not first else None)
        rows.append(
            {
                "turn": k + 1,
                "ttft_s": round(first[0] - start, 4) if first else None,
                "prefilled": reply.prefilled,
                "reused": reply.reused,
                "dropped": reply.dropped,
                "reply_tokens": len(reply.tokens),
                "stop_reason": reply.stop_reason,
            }
        )
        print(
            f"turn {k + 1:2}: prefilled {reply.prefilled:4}  reused {reply.reused:4}  dropped {reply.dropped}  "
            f"ttft {rows[-1]['ttft_s']} s  {reply.stop_reason}: {reply.text[:50]!r}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.long_chat", description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, help="an export of SmolLM2-135M-Instruct (default: exported now)")
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "long_chat.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or Path(tmp) / "smollm2"
        if args.folder is None:
            export(folder, args.max_seq_len)
        rows = converse(folder, args.turns, args.max_new_tokens)
    reused = [r["ttft_s"] for r in rows[1:] if not r["dropped"] and r["ttft_s"] is not None]
    dropped = [r for r in rows if r["dropped"]]
    summary = {
        "turns": len(rows),
        "turns_dropping": len(dropped),
        "ttft_median_s_reusing_the_cache": statistics.median(reused) if reused else None,
        "ttft_median_s_after_a_drop": statistics.median(r["ttft_s"] for r in dropped) if dropped else None,
        "prefilled_median_reusing_the_cache": statistics.median(r["prefilled"] for r in rows[1:] if not r["dropped"]),
        "prefilled_median_after_a_drop": statistics.median(r["prefilled"] for r in dropped) if dropped else None,
        "replies_ending_their_turn": sum(r["stop_reason"] == "eos" for r in rows),
    }
    print(json.dumps(summary, indent=2))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"host": machine(), "summary": summary, "turns": rows}, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
