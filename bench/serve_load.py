"""`genai serve` under load, on loopback only: for each --parallel N a server of its own (a child
process), its RSS once loaded and at its peak, then C concurrent streaming clients of R chat
requests each (throughput, time to first token p50 / p95, errors, lost requests), and for N = 1
the time to first token of a conversation's turn 5 with its cache reused and without (medians).
Every loop is bounded: C x R requests, each with a timeout; the script stops by itself.

    .venv/bin/python -m bench.serve_load out/smollm2-135m-instruct --parallel 1 4 --clients 8 --requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai

from bench.harness import ROOT, machine

QUESTIONS = (
    "What is the capital of France?",
    "Tell me about the history of Rome.",
    "How do bees make honey?",
    "Why is the sky blue?",
    "What should I pack for a hike?",
    "Explain what a CPU does.",
    "Give me a recipe for pancakes.",
    "What is photosynthesis?",
)
TURNS = (
    "Tell me about Paris.",
    "What are its best museums?",
    "Describe the Louvre in detail.",
    "What is the Mona Lisa?",
    "Who painted it, and when?",
)
REQUEST_TIMEOUT = 300.0


class Server:
    """`genai serve FOLDER --port 0 --parallel N` in a child process."""

    def __init__(self, folder: Path, parallel: int, lookahead: int):
        command = [sys.executable, "-m", "genai_pipeline.cli", "serve", str(folder), "--port", "0"]
        self.process = subprocess.Popen(
            [*command, "--parallel", str(parallel), "--lookahead", str(lookahead)],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.process.stderr), daemon=True).start()
        deadline = time.monotonic() + 600
        while not (found := [re.search(r" on (http://\S+/v1) ", line) for line in self.lines if "serving" in line]):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"genai serve did not start:\n{''.join(self.lines)}")
            time.sleep(0.1)
        self.url = found[0].group(1)

    def rss_mb(self, field: str) -> float:
        """VmRSS (now) or VmHWM (peak) of the server process, MB."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) / 1024

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait(timeout=60)


async def streamed(client, model: str, messages, max_tokens: int) -> dict:
    """One streaming chat request: seconds to the first text, the token counts, or the error."""
    start = time.perf_counter()
    first, usage = None, None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text = ""
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter() - start
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
    except openai.APIError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if usage is None:
        return {"error": "the stream ended without its usage chunk"}
    return {
        "ttft": first if first is not None else time.perf_counter() - start,
        "seconds": time.perf_counter() - start,
        "text": text,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
        "completion_tokens": usage.completion_tokens,
    }


async def load(url: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT)

    async def one_client(c: int) -> list[dict]:
        messages = [{"role": "user", "content": QUESTIONS[c % len(QUESTIONS)]}]
        return [await streamed(client, model, messages, max_tokens) for _ in range(requests)]

    start = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(one_client(c) for c in range(clients))) for r in rs]
    wall = time.perf_counter() - start
    await client.close()
    done = [r for r in results if "error" not in r]
    ttfts = sorted(r["ttft"] for r in done)
    tokens = sum(r["completion_tokens"] for r in done)
    return {
        "requests": clients * requests,
        "completed": len(done),
        "errors": len(results) - len(done),
        "lost": clients * requests - len(results),
        "first_errors": [r["error"] for r in results if "error" in r][:3],
        "wall_s": round(wall, 2),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2),
        "requests_per_s": round(len(done) / wall, 3),
        "ttft_p50_ms": round(1e3 * percentile(ttfts, 50), 1) if ttfts else None,
        "ttft_p95_ms": round(1e3 * percentile(ttfts, 95), 1) if ttfts else None,
    }


def percentile(sorted_values: list[float], p: float) -> float:
    """Nearest rank."""
    return sorted_values[min(len(sorted_values) - 1, max(0, round(p / 100 * len(sorted_values) + 0.5) - 1))]


async def fifth_turn(url: str, model: str, repeats: int, reply_tokens: int) -> dict:
    """Turns 1-4 of a conversation (replies of up to `reply_tokens`), then turn 5 twice: right after
    turn 4 (its session's cache holds the conversation) and after an unrelated request has taken
    the session (only the template's first tokens, if any, are still shared)."""
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT)
    reused, cold = [], []
    for _ in range(repeats):
        await client.completions.create(model=model, prompt="Once upon a time", max_tokens=1)  # a fresh start
        messages = []
        for question in TURNS[:-1]:
            messages.append({"role": "user", "content": question})
            reply = await streamed(client, model, messages, reply_tokens)
            messages.append({"role": "assistant", "content": reply["text"]})
        messages.append({"role": "user", "content": TURNS[-1]})
        reused.append(await streamed(client, model, messages, 8))
        await client.completions.create(model=model, prompt="Once upon a time", max_tokens=1)
        cold.append(await streamed(client, model, messages, 8))
    await client.close()

    def summary(runs: list[dict]) -> dict:
        return {
            "ttft_ms": round(1e3 * statistics.median(r["ttft"] for r in runs), 1),
            "prompt_tokens": runs[0]["prompt_tokens"],
            "cached_tokens": runs[0]["cached_tokens"],
            "prefilled_tokens": runs[0]["prompt_tokens"] - runs[0]["cached_tokens"],
        }

    return {"repeats": repeats, "with_reuse": summary(reused), "without_reuse": summary(cold)}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_load", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="an export folder of a chat model")
    parser.add_argument("--parallel", type=int, nargs="+", default=[1, 4], help="server sessions, one server each")
    parser.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, default=16, help="requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per reply at most")
    parser.add_argument("--lookahead", type=int, default=0, help="the servers' --lookahead")
    parser.add_argument("--turn-repeats", type=int, default=5, help="conversations for the turn-5 medians (0: none)")
    parser.add_argument("--turn-reply-tokens", type=int, default=96, help="tokens per reply of turns 1-4 at most")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "serve_load.json")
    args = parser.parse_args()

    host = machine()
    report = {"machine": {k: v for k, v in host.items() if k != "cpu_flags"}, "folder": str(args.folder), "servers": []}
    for n in args.parallel:
        server = Server(args.folder, n, args.lookahead)
        try:
            model = openai.OpenAI(base_url=server.url, api_key="unused").models.list().data[0].id
            row = {"parallel": n, "model": model, "rss_loaded_mb": round(server.rss_mb("VmRSS"), 1)}
            row["load"] = asyncio.run(load(server.url, model, args.clients, args.requests, args.max_tokens))
            row["rss_peak_mb"] = round(server.rss_mb("VmHWM"), 1)
            if n == 1 and args.turn_repeats:
                row["turn_5"] = asyncio.run(fifth_turn(server.url, model, args.turn_repeats, args.turn_reply_tokens))
        finally:
            server.stop()
        report["servers"].append(row)
        print(json.dumps(row, indent=2), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{host['cpu_model']}, {host['cpus']} cores, load average {host['loadavg_start'][0]:.1f}; written to {args.json}"
    )
    for row in report["servers"]:
        lo = row["load"]
        print(
            f"--parallel {row['parallel']}: RSS {row['rss_loaded_mb']:.0f} MB loaded, {row['rss_peak_mb']:.0f} MB peak; "
            f"{lo['completed']}/{lo['requests']} requests in {lo['wall_s']} s, {lo['tokens_per_s']} tok/s, "
            f"TTFT p50 {lo['ttft_p50_ms']} ms p95 {lo['ttft_p95_ms']} ms, {lo['errors']} errors, {lo['lost']} lost"
        )
        if "turn_5" in row:
            t = row["turn_5"]
            for name in ("with_reuse", "without_reuse"):
                r = t[name]
                print(
                    f"  turn 5 {name.replace('_', ' ')}: TTFT {r['ttft_ms']} ms (median of {t['repeats']}), "
                    f"{r['prefilled_tokens']} of {r['prompt_tokens']} prompt tokens prefilled"
                )
    return 0 if all(r["load"]["errors"] == 0 and r["load"]["lost"] == 0 for r in report["servers"]) else 1


if __name__ == "__main__":
    sys.exit(main())
