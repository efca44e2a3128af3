"""Where a decode step's time goes: ExecuTorch's own profiler (ETDump, which the 1.5.1 wheel fills with
XNNPACK's per-operator times too) over decode steps of one program, summed by operator name.

    .venv/bin/python -m bench.etdump_decode PROGRAM.pte [--caller genai|optimum] [--threads 2] [--steps 64] \
        [--prompt 128] [--method verify --tokens 8] [--json out.json]

A 128-token prompt goes in first (positions 0-127; `--prompt 0`: none, for a program with no prompt
method, as a `--mode kv` export's `decode_token`), then `--steps` single-token steps through `forward`
(a dynamic program's; `--caller optimum` passes positions as optimum-executorch's programs take them, a
cache_position per token). `--method verify --tokens 8` times a lookahead program's verify calls instead:
8 tokens a call, the call at position p + 1 after the one at p (the rows a call writes past its first
are overwritten by the next, as when one draft token is accepted). Per operator: the median over the
steps of its time in a step (all its calls in that step), in ms. Method::execute is the step's wall time
inside the runtime.
"""

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as genai bench (docs/decisions/0002)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.etdump_decode")
    parser.add_argument("program")
    parser.add_argument(
        "--caller",
        choices=("genai", "optimum"),
        default="genai",
        help="genai: forward(tokens, input_pos [1]); optimum: forward(tokens, cache_position [T])",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--method", default="forward", help="forward, or verify (a lookahead program's)")
    parser.add_argument("--tokens", type=int, default=1, help="tokens a step (verify: the program's verify length)")
    parser.add_argument("--json")
    args = parser.parse_args()

    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  kernels the programs call
    import executorch.kernels.quantized  # noqa: F401
    import torch
    from executorch.devtools import Inspector
    from executorch.extension.pybindings import portable_lib

    portable_lib._unsafe_reset_threadpool(args.threads)
    module = portable_lib._load_for_executorch(args.program, enable_etdump=True, debug_buffer_size=0)

    def call(tokens: list[int], pos: int, method: str = "forward") -> torch.Tensor:
        positions = (torch.tensor([pos]) if args.caller == "genai" else torch.arange(pos, pos + len(tokens))).long()
        return module.run_method(method, (torch.tensor([tokens], dtype=torch.long), positions))[0]

    if args.prompt:
        call(list(range(100, 100 + args.prompt)), 0)
    token, walls = 5, []
    for step in range(args.steps):
        start = time.perf_counter()
        logits = call([token] * args.tokens, args.prompt + step, args.method)
        walls.append(time.perf_counter() - start)
        token = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "etdump")
        module.write_etdump_result_to_file(path)
        blocks = [
            [e for e in block.events if e.perf_data is not None] for block in Inspector(etdump_path=path).event_blocks
        ]
    # The timed method's block: one per method run; `forward`'s holds the prompt's call first
    prompt_calls = int(args.method == "forward" and args.prompt > 0)
    calls = args.steps + prompt_calls
    events = next(
        (b for b in blocks if any(e.name == "Method::execute" and len(e.perf_data.raw) == calls for e in b)), None
    )
    if events is None:
        sys.exit(
            f"{args.program}: ETDump holds no run of {calls} calls of one method (is `{args.method}` one of its methods?)"
        )
    per_step = collections.defaultdict(lambda: [0.0] * args.steps)
    counts = collections.Counter()
    for event in events:
        raw = event.perf_data.raw  # ms, one entry per occurrence, in order
        if len(raw) % calls:
            continue  # Program::load_method, Method::init: once
        per_call = len(raw) // calls
        counts[event.name] += per_call
        for step in range(args.steps):
            per_step[event.name][step] += sum(
                raw[(step + prompt_calls) * per_call : (step + prompt_calls + 1) * per_call]
            )
    ops = {name: statistics.median(times) for name, times in per_step.items()}
    print(
        f"{args.program}: {args.threads} threads, {args.method} calls of {args.tokens} tokens at "
        f"{args.prompt}-{args.prompt + args.steps - 1}, "
        f"wall median {1e3 * statistics.median(walls):.3f} ms a step"
    )
    for name, ms in sorted(ops.items(), key=lambda kv: -kv[1]):
        if ms >= 0.005:
            print(f"{ms:9.3f} ms  {counts[name]:5d} calls  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "program": args.program,
                    "threads": args.threads,
                    "steps": args.steps,
                    "prompt": args.prompt,
                    "method": args.method,
                    "tokens": args.tokens,
                    "wall_ms": 1e3 * statistics.median(walls),
                    "ops_ms": {n: {"ms": ms, "calls": counts[n]} for n, ms in ops.items()},
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    sys.exit(main())
