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
    for line in _table(result["rows"]):
        print(line)
    log.info("wrote %s and %s", Path(args.out) / SWEEP_JSON, Path(args.out) / REPORT)
    failed = sum(r["status"] == "failed" for r in result["rows"])
    if failed:
        log.warning("%d of %d tasks failed (their errors above); a re-run retries them", failed, len(result["rows"]))
        return 1
    return 0


TEXT_CELLS = {
    "program MB": lambda r: f"{r['program_mb']:.2f}",
    "perplexity": lambda r: f"{r['perplexity_change_pct']:+.2f}%",
}
IMAGE_CELLS = {  # a vision-language model's rows
    "answer ppl": lambda r: f"{r['answer_perplexity_change_pct']:+.3f}%",
    "exact match": lambda r: f"{100 * r['exact_match']:.1f}%",
}


def _table(rows: list[dict]) -> list[str]:
    """A line per row: its size, its changes against float, its decode speed; the image questions'
    columns where some row answered them. n/a: not measured for that row (a vision-language model
    with no text to score)."""
    cells = dict(TEXT_CELLS)
    if any("exact_match" in r for r in rows):
        cells.update(IMAGE_CELLS)
    cells["decode tok/s"] = lambda r: f"{r['decode_tokens_per_s']:.1f}"

    def cell(r, name):
        try:
            return cells[name](r)
        except KeyError:
            return "n/a"

    widths = {name: max(10, len(name)) for name in cells}
    lines = [f"{'task':<32} " + " ".join(f"{name:>{widths[name]}}" for name in cells) + "  status"]
    for r in rows:
        if r["status"] == "done":
            values = " ".join(f"{cell(r, name):>{widths[name]}}" for name in cells)
            lines.append(f"{r['task']:<32} {values}  done")
        else:
            blank = " ".join(" " * widths[name] for name in cells)
            lines.append(f"{r['task']:<32} {blank}  failed: {r['error']}")
    return lines
