"""What an LM head's most frequent rows at 8 bits cost a decode step: the head alone, as XNNPACK runs it.

A [vocab, dim] head (default Gemma 3's, 262,144 x 640) is lowered to XNNPACK in each of three forms:
one 8da4w linear (the default), its first N rows as an 8da8w linear and the rest as an 8da4w one
with the two outputs concatenated (a table whose lowest ids, its most frequent tokens, are kept at 8
bits), and one 8da8w linear. One token in (M=1, as in decode), random weights (the kernels' time does
not depend on the values); rounds interleave the programs, each round times `--passes` calls per
program, the table shows medians over rounds. Decision 0037.

    .venv/bin/python -m bench.head_split [--vocab 262144] [--dim 640] [--rows 8192 32768] [--threads 1 2]
        [--rounds 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def build(vocab: int, dim: int, rows: int, path: Path) -> int:
    """The head with its first `rows` rows at 8 bits (0: all at 4, vocab: all at 8), written to
    `path`; returns the program's bytes."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torch import nn
    from torchao.quantization import quantize_

    from genai_pipeline.quantize.weights import linear_config

    parts = [(n, recipe) for n, recipe in ((rows, "8da8w"), (vocab - rows, "8da4w")) if n]

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.parts = nn.ModuleList(nn.Linear(dim, n, bias=False) for n, _ in parts)

        def forward(self, h):
            logits = [part(h) for part in self.parts]
            return logits[0] if len(logits) == 1 else torch.cat(logits, dim=-1)

    torch.manual_seed(0)
    head = Head()
    for linear, (_, recipe) in zip(head.parts, parts):
        quantize_(linear, linear_config(recipe, 32), filter_fn=lambda m, _: isinstance(m, nn.Linear))
    exported = torch.export.export(head, (torch.randn(1, dim),))
    program = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch()
    path.write_bytes(program.buffer)
    return len(program.buffer)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.head_split", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--dim", type=int, default=640)
    parser.add_argument("--rows", type=int, nargs="+", default=[8192, 32768], help="rows kept at 8 bits")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--passes", type=int, default=60)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from executorch.extension.pybindings import portable_lib

    from bench.harness import machine

    forms = [0, *args.rows, args.vocab]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sizes = {}
        for n in forms:
            sizes[n] = build(args.vocab, args.dim, n, Path(tmp) / f"head-{n}.pte")
            print(f"built: {n} of {args.vocab} rows at 8 bits, {sizes[n] / 2**20:.1f} MiB", flush=True)
        x = torch.randn(1, args.dim)
        for threads in args.threads:
            portable_lib._unsafe_reset_threadpool(threads)
            programs = {n: portable_lib._load_for_executorch(str(Path(tmp) / f"head-{n}.pte")) for n in forms}
            for program in programs.values():
                for _ in range(5):
                    program.forward((x,))
            samples = {n: [] for n in forms}
            for _ in range(args.rounds):
                for n, program in programs.items():
                    times = []
                    for _ in range(args.passes):
                        start = time.perf_counter()
                        program.forward((x,))
                        times.append(time.perf_counter() - start)
                    samples[n].append(statistics.median(times))
            base = statistics.median(samples[0])
            for n in forms:
                ms = statistics.median(samples[n]) * 1e3
                rows.append(
                    {
                        "threads": threads,
                        "rows_8bit": n,
                        "mib": round(sizes[n] / 2**20, 1),
                        "ms": round(ms, 3),
                        "vs_4bit": round(ms / (base * 1e3) - 1, 4),
                    }
                )
    host = machine()
    print(
        f"\n{host['cpu_model']} (family {host['cpu_family']} model {host['cpu_model_number']}); head [{args.vocab}, {args.dim}]"
    )
    print(f"{'threads':>7} {'rows at 8 bits':>14} {'MiB':>7} {'ms':>7} {'vs 4-bit':>9}")
    for r in rows:
        print(f"{r['threads']:7d} {r['rows_8bit']:14d} {r['mib']:7.1f} {r['ms']:7.3f} {100 * r['vs_4bit']:+8.1f}%")
    if args.json:
        args.json.write_text(json.dumps({"machine": host, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
