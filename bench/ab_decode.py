"""Decode steps (hybrid: `decode_token`, `decode` in older exports; dynamic: `forward`) of two programs interleaved in one process (A, B, B, A, ...): median step times.
On a shared, loaded machine side-by-side runs of `genai bench` vary 2x; steps interleaved this
finely see the same load.

    .venv/bin/python -m bench.ab_decode A/text_decoder.pte B/text_decoder.pte [--steps 4000] [--threads 2]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as genai bench (docs/decisions/0002)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ab_decode")
    parser.add_argument("programs", nargs=2)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=1, help="ExecuTorch's threadpool (as genai bench --threads)")
    args = parser.parse_args()

    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  kernels the programs call
    import executorch.kernels.quantized  # noqa: F401
    import torch
    from executorch.extension.pybindings import portable_lib
    from executorch.runtime import Runtime

    portable_lib._unsafe_reset_threadpool(args.threads)

    programs = [Runtime.get().load_program(p) for p in args.programs]
    # a hybrid program's one-token method (named `decode` before docs/decisions/0035), a dynamic one's forward
    methods = [
        p.load_method(next(m for m in ("decode_token", "decode", "forward") if m in p.method_names)) for p in programs
    ]
    times = [[], []]
    token = torch.tensor([[7]])
    for step in range(args.steps):
        position = torch.tensor([step % 256])
        for i in (0, 1) if step % 2 else (1, 0):
            start = time.perf_counter()
            methods[i].execute([token, position])
            times[i].append(time.perf_counter() - start)
    for program, t in zip(args.programs, times):
        t = t[args.steps // 20 :]  # warm-up
        q = statistics.quantiles(t, n=4)
        print(f"{program}: median {statistics.median(t) * 1e6:.1f} us (p25 {q[0] * 1e6:.1f}, p75 {q[2] * 1e6:.1f})")


if __name__ == "__main__":
    main()
