"""Benchmark of the vertical slice: export time and peak RSS, prefill and decode speed.

For each model (the shipped reference; SmolLM2-135M's shape with random weights) and each mode
(hybrid, kv, dynamic) on xnnpack: `genai export` in a child process (wall time, peak RSS from
wait4), then `genai bench` in a child process (a 128-token prefill and 128 decode steps,
repeated; medians). Prints a table and writes JSON.

    .venv/bin/python -m bench.slice [--models reference smollm2-135m] [--modes hybrid kv dynamic]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

from bench.harness import HERE, run_child


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.slice", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["reference", "smollm2-135m"])
    parser.add_argument("--modes", nargs="+", default=["hybrid", "kv", "dynamic"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--json", default=str(HERE / "results" / "slice.json"))
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for mode in args.modes:
                out = Path(tmp) / f"{model}-{mode}"
                export_s, export_rss, _ = run_child(
                    [
                        sys.executable,
                        "-m",
                        "genai_pipeline.cli",
                        "export",
                        model,
                        "--mode",
                        mode,
                        "--max-seq-len",
                        str(args.max_seq_len),
                        "--out",
                        str(out),
                    ]
                )
                _, run_rss, printed = run_child(
                    [
                        sys.executable,
                        "-m",
                        "genai_pipeline.cli",
                        "bench",
                        str(out),
                        "--json",
                        "--prompt-len",
                        str(args.prompt_len),
                        "--gen-len",
                        str(args.gen_len),
                        "--repeats",
                        str(args.repeats),
                    ]
                )
                row = {
                    "model": model,
                    "mode": mode,
                    "target": "xnnpack",
                    "recipe": "fp32",
                    "export_s": round(export_s, 1),
                    "export_peak_rss_mb": round(export_rss),
                    "pte_mb": round((out / "text_decoder.pte").stat().st_size / 2**20, 1),
                    "run_peak_rss_mb": round(run_rss),
                    **json.loads(printed),
                }
                rows.append(row)
                print(
                    f"{model:<14} {mode:<8} export {row['export_s']:>6.1f} s  {row['export_peak_rss_mb']:>5} MB RSS  "
                    f"pte {row['pte_mb']:>6.1f} MB  prefill {row['prefill_tokens_per_s']:>8.1f} tok/s  "
                    f"decode {row['decode_tokens_per_s']:>7.1f} tok/s  (run RSS {row['run_peak_rss_mb']} MB)",
                    flush=True,
                )
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "settings": {k: getattr(args, k) for k in ("prompt_len", "gen_len", "repeats", "max_seq_len")},
        "rows": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
