"""How fast XNNPACK's decode-shaped matmuls read weights from memory, per genai recipe.

A stack of square linears, one token in (M=1, as in decode), quantized with genai's own recipe
configs and lowered to XNNPACK, its weights far larger than the last-level cache; the rate at which
it reads its weights, against `genai bench`'s copy bandwidth measured in the same run. This is
the ceiling of a decode's bandwidth share with these kernels, whatever the program around them.

    .venv/bin/python -m bench.gemv [--dim 4096] [--layers 16] [--rounds 3] [--json FILE]
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

RECIPES = {"8da4w-g32": ("8da4w", 32), "8da4w-g128": ("8da4w", 128), "8da8w": ("8da8w", 32)}


def build(recipe: str, group_size: int, dim: int, layers: int, path: Path) -> int:
    """Writes the program; returns the bytes of weights it holds."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torch import nn
    from torchao.quantization import quantize_

    from genai_pipeline.quantize.weights import linear_config

    torch.manual_seed(0)
    stack = nn.Sequential(*[nn.Linear(dim, dim, bias=False) for _ in range(layers)])
    quantize_(stack, linear_config(recipe, group_size))
    exported = torch.export.export(stack, (torch.randn(1, dim),))
    program = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch()
    path.write_bytes(program.buffer)
    return len(program.buffer)  # the weights, and a few KB of program around them


def seconds_per_pass(path: Path, dim: int, threads: int, passes: int = 50) -> float:
    import torch
    from executorch.extension.pybindings import portable_lib

    portable_lib._unsafe_reset_threadpool(threads)
    module = portable_lib._load_for_executorch(str(path))
    x = torch.randn(1, dim)
    for _ in range(5):
        module.forward((x,))
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        module.forward((x,))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gemv", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=16, help="enough that the weights overflow the caches")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds over the recipes; medians reported")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from genai_pipeline.bench.host import memory_bandwidth_gbs

    with tempfile.TemporaryDirectory() as tmp:
        programs = {}
        for name, (recipe, group_size) in RECIPES.items():
            print(f"building {name}: {args.layers} x [{args.dim}, {args.dim}]", flush=True)
            path = Path(tmp) / f"{name}.pte"
            programs[name] = (path, build(recipe, group_size, args.dim, args.layers, path))
        samples = {name: [] for name in RECIPES}
        copy = []
        for round_ in range(args.rounds):
            copy.append(memory_bandwidth_gbs())
            for name, (path, weight_bytes) in programs.items():
                samples[name].append(weight_bytes / seconds_per_pass(path, args.dim, args.threads) / 1e9)
            print(
                f"round {round_ + 1}/{args.rounds}: copy {copy[-1]:.1f} GB/s, "
                + ", ".join(f"{n} {s[-1]:.1f}" for n, s in samples.items()),
                flush=True,
            )
    copy_gbs = statistics.median(copy)
    rows = [
        {
            "recipe": name,
            "weight_mb": round(programs[name][1] / 2**20, 1),
            "read_gbs": round(statistics.median(s), 2),
            "share_of_copy_bandwidth": round(statistics.median(s) / copy_gbs, 3),
        }
        for name, s in samples.items()
    ]
    print(f"\ncopy bandwidth (genai bench's probe): {copy_gbs:.1f} GB/s; {args.threads} threads")
    print(f"{'recipe':12s} {'weights MB':>10s} {'read GB/s':>10s} {'share':>7s}")
    for row in rows:
        print(
            f"{row['recipe']:12s} {row['weight_mb']:10.1f} {row['read_gbs']:10.2f} {row['share_of_copy_bandwidth']:7.1%}"
        )
    if args.json:
        result = {
            "dim": args.dim,
            "layers": args.layers,
            "threads": args.threads,
            "rounds": args.rounds,
            "copy_bandwidth_gbs": round(copy_gbs, 2),
            "copy_samples": [round(c, 2) for c in copy],
            "rows": rows,
            "samples": {n: [round(v, 2) for v in s] for n, s in samples.items()},
        }
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
