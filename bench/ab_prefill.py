"""One prefill call of several programs interleaved in one process (A, B, C, A, B, C, ...): median call times.
Each program names the method to time: a hybrid program's `prefill` or `prefill_chunk`, a dynamic one's
`forward`, given the same T tokens from position 0. Interleaved calls see the same load on a shared host.

    .venv/bin/python -m bench.ab_prefill A/text_decoder.pte:prefill B/text_decoder.pte:forward \
        [--tokens 128] [--calls 60] [--threads 2]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as genai bench (docs/decisions/0002)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ab_prefill")
    parser.add_argument("programs", nargs="+", help="PATH:METHOD")
    parser.add_argument("--tokens", type=int, default=128, help="the call's length (a static method's own)")
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1, help="ExecuTorch's threadpool (as genai bench --threads)")
    args = parser.parse_args()

    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  kernels the programs call
    import executorch.kernels.quantized  # noqa: F401
    import torch
    from executorch.extension.pybindings import portable_lib
    from executorch.runtime import Runtime

    portable_lib._unsafe_reset_threadpool(args.threads)
    named = [p.rsplit(":", 1) for p in args.programs]
    methods = [Runtime.get().load_program(path).load_method(method) for path, method in named]
    tokens = torch.randint(0, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    times = [[] for _ in methods]
    for _ in range(args.calls):
        for method, t in zip(methods, times):
            start = time.perf_counter()
            method.execute([tokens, torch.tensor([0])])
            t.append(time.perf_counter() - start)
    for program, t in zip(args.programs, times):
        t = t[max(1, args.calls // 20) :]  # warm-up
        print(f"{program}: median {statistics.median(t) * 1e3:.2f} ms ({args.tokens / statistics.median(t):.0f} tok/s)")


if __name__ == "__main__":
    main()
