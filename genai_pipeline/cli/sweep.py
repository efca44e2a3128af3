"""`genai sweep SPEC.yaml --out DIR`: every (model, variant) of a spec exported, verified, evaluated
and benchmarked as tasks on Ray (genai_pipeline/sweep/); a table here, sweep.json and report.html in DIR."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("genai_pipeline")


def cmd_sweep(args) -> int:
    from genai_pipeline.sweep.report import REPORT, SWEEP_JSON
    from genai_pipeline.sweep.run import run_sweep
    from genai_pipeline.sweep.spec import read_spec

    spec = read_spec(args.spec)  # every error of the spec, before Ray starts
    result = run_sweep(spec, Path(args.out), Path(args.storage) if args.storage else None, args.address)
    print(f"{'task':<32} {'program MB':>10} {'perplexity':>10} {'decode tok/s':>12}  status")
    for r in result["rows"]:
        if r["status"] == "done":
            speed = f"{r['decode_tokens_per_s']:.1f}"
            print(f"{r['task']:<32} {r['program_mb']:>10.2f} {r['perplexity_change_pct']:>+9.2f}% {speed:>12}  done")
        else:
            print(f"{r['task']:<32} {'':>10} {'':>10} {'':>12}  failed: {r['error']}")
    log.info("wrote %s and %s", Path(args.out) / SWEEP_JSON, Path(args.out) / REPORT)
    failed = sum(r["status"] == "failed" for r in result["rows"])
    if failed:
        log.warning("%d of %d tasks failed (their errors above); a re-run retries them", failed, len(result["rows"]))
        return 1
    return 0
