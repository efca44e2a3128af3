"""A sweep's results: sweep.json (a row per task) and report.html, a self-contained page (inline
SVG, no script, no plotting library) with, per model, the Pareto chart of perplexity change against
program size coloured by decode speed, the table with its Pareto-optimal rows marked, and a
recommendation line per size class."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from genai_pipeline.export_folder import atomic_write
from genai_pipeline.sweep.spec import Report

SWEEP_JSON = "sweep.json"
REPORT = "report.html"
# Decode speed, slow to fast: a perceptually ordered ramp (viridis' ends and middle), readable in grey.
RAMP = ((68, 1, 84), (33, 145, 140), (253, 231, 37))


def write_report(out: Path, result: dict, options: Report) -> None:
    result = {**result, "machines": machines(result["rows"])}
    atomic_write(Path(out) / SWEEP_JSON, json.dumps(result, indent=1))
    atomic_write(Path(out) / REPORT, render(result, options))


def machines(rows: list[dict]) -> list[dict]:
    """The distinct machines the speed figures come from."""
    seen = []
    for row in rows:
        if row.get("machine") and row["machine"] not in seen:
            seen.append(row["machine"])
    return seen


def pareto(rows: list[dict]) -> set[str]:
    """The tasks no other row beats on both program size and perplexity change."""
    done = [r for r in rows if r.get("status") == "done"]

    def beats(a, b):
        return (
            a["program_mb"] <= b["program_mb"]
            and a["perplexity_change_pct"] <= b["perplexity_change_pct"]
            and (a["program_mb"] < b["program_mb"] or a["perplexity_change_pct"] < b["perplexity_change_pct"])
        )

    return {r["task"] for r in done if not any(beats(o, r) for o in done)}


def size_classes(rows: list[dict], options: Report) -> tuple[float, ...]:
    """The spec's size classes, else 1-2-5 steps (MB) from the smallest program's to the largest's."""
    if options.size_classes_mb:
        return tuple(sorted(options.size_classes_mb))
    sizes = [r["program_mb"] for r in rows if r.get("status") == "done"]
    if not sizes:
        return ()
    steps = [m * 10**e for e in range(-1, 6) for m in (1, 2, 5)]
    first = next(i for i, s in enumerate(steps) if s >= min(sizes))
    last = next(i for i, s in enumerate(steps) if s >= max(sizes))
    return tuple(steps[first : last + 1])


def recommendations(rows: list[dict], options: Report) -> list[str]:
    """One line for the tolerance, one per size class."""
    done = [r for r in rows if r.get("status") == "done"]
    if not done:
        return ["no task finished: nothing to recommend"]
    tolerance = options.max_perplexity_change
    within = [r for r in done if r["perplexity_change_pct"] <= tolerance]
    lines = [
        f"smallest program within +{tolerance:g} % perplexity: "
        + (_describe(min(within, key=lambda r: r["program_mb"])) if within else "none")
    ]
    for limit in size_classes(rows, options):
        fits = [r for r in done if r["program_mb"] <= limit]
        best = min(fits, key=lambda r: r["perplexity_change_pct"]) if fits else None
        lines.append(
            f"up to {limit:g} MB: " + (f"lowest perplexity change: {_describe(best)}" if best else "none fits")
        )
    return lines


def _describe(row: dict) -> str:
    speed = f", {row['decode_tokens_per_s']:.1f} tok/s decode" if row.get("decode_tokens_per_s") else ""
    return f"{row['variant']} ({row['program_mb']:.1f} MB, {row['perplexity_change_pct']:+.2f} %{speed})"


def render(result: dict, options: Report) -> str:
    rows = result["rows"]
    where = result["machines"]
    if not where:
        machine_line = "No speed was measured."
    else:
        named = "; ".join(
            f"{html.escape(m['cpu'])} ({m.get('vector') or 'no AVX2'}), {m['threads']} threads on {m['cores']} cores "
            f"({html.escape(m['host'])})"
            for m in where
        )
        machine_line = f"Speeds measured on {named}, each bench alone on its Ray node."
        shared = [m for m in where if m.get("ray_nodes_on_host")]
        if shared:
            machine_line += (
                " <b>Measured under load:</b> "
                + "; ".join(
                    f"{m['ray_nodes_on_host']} Ray nodes share {html.escape(m['host'])}, their other tasks ran beside the bench"
                    for m in shared
                )
                + "."
            )
        if len(where) > 1:
            machine_line += " <b>They come from different machines: compare speeds within one machine only.</b>"
    models = list(dict.fromkeys(r["model"] for r in rows))
    sections = [_model_section(model, [r for r in rows if r["model"] == model], options) for model in models]
    title = f"genai sweep — {Path(result['spec']).name}"
    return f"""<!doctype html>
<meta charset=utf-8>
<title>{html.escape(title)}</title>
<style>
body{{font-family:sans-serif;max-width:64em;margin:2em auto}} td,th{{padding:2px 8px}}
.num{{text-align:right;font-variant-numeric:tabular-nums}} tr.pareto td{{font-weight:bold}} .err{{color:#c0392b}}
</style>
<h1>{html.escape(title)}</h1>
<p>{len(rows)} of {result["ran"] + result["skipped"]} tasks ended ({result["skipped"]} of them before this run), in
{result["seconds"] / 60:.1f} min.
{machine_line} Perplexity change: the program's perplexity over its float model's on the evaluation text.</p>
{"".join(sections)}
"""


def _model_section(model: str, rows: list[dict], options: Report) -> str:
    best = pareto(rows)
    lines = "".join(f"<li>{html.escape(line)}</li>" for line in recommendations(rows, options))
    body = "\n".join(_table_row(r, r["task"] in best) for r in rows)
    return f"""<h2>{html.escape(model)}</h2>
{_chart(rows, best)}
<ul>{lines}</ul>
<table><tr><th>variant<th>recipe<th>mode<th>program MB<th>perplexity<th>change %<th>KL<th>top-1 %
<th>decode tok/s<th>prefill tok/s<th>peak RSS MB<th>export min<th>export RSS MB<th>Pareto</tr>
{body}
</table>
"""


def _table_row(r: dict, optimal: bool) -> str:
    name = html.escape(r["variant"])
    if r.get("status") != "done":
        return f"<tr><td>{name}<td colspan=13 class=err>failed: {html.escape(r.get('error', ''))}</tr>"
    cells = [
        html.escape(r["recipe"]),
        html.escape(r["mode"]),
        f"{r['program_mb']:.2f}",
        f"{r['perplexity']:.3f}",
        f"{r['perplexity_change_pct']:+.2f}",
        f"{r['kl_divergence']:.5f}",
        f"{100 * r['top1_agreement']:.2f}",
        f"{r['decode_tokens_per_s']:.1f}",
        f"{r['prefill_tokens_per_s']:.1f}",
        f"{r['peak_rss_mb']:.0f}",
        f"{r['export_minutes']:.1f}",
        "n/a" if r.get("export_peak_rss_mb") is None else f"{r['export_peak_rss_mb']:.0f}",
    ]
    tds = "".join(f"<td class=num>{c}" for c in cells[2:])
    mark = "◆" if optimal else ""
    return f"<tr{' class=pareto' if optimal else ''}><td>{name}<td>{cells[0]}<td>{cells[1]}{tds}<td>{mark}</tr>"


def _colour(t: float) -> str:
    """A point of RAMP, t in [0, 1]."""
    t = min(max(t, 0.0), 1.0) * (len(RAMP) - 1)
    i = min(int(t), len(RAMP) - 2)
    a, b = RAMP[i], RAMP[i + 1]
    return "#" + "".join(f"{round(x + (y - x) * (t - i)):02x}" for x, y in zip(a, b))


def _chart(rows: list[dict], best: set[str], width: int = 640, height: int = 340) -> str:
    done = [r for r in rows if r.get("status") == "done"]
    if not done:
        return ""
    left, right, top, bottom = 60, 110, 20, 45
    w, h = width - left - right, height - top - bottom
    x_max = max(r["program_mb"] for r in done) * 1.08
    y_values = [r["perplexity_change_pct"] for r in done]
    y_min, y_max = min(0.0, *y_values), max(y_values)
    y_max = y_max + 0.1 * (y_max - y_min) if y_max > y_min else y_min + 1
    speeds = [r["decode_tokens_per_s"] for r in done if r.get("decode_tokens_per_s")]
    lo, hi = (min(speeds), max(speeds)) if speeds else (0, 0)

    def x(v):
        return left + w * v / x_max

    def y(v):
        return top + h * (y_max - v) / (y_max - y_min)

    parts = [
        _svg("line", x1=left, y1=y(0), x2=left + w, y2=y(0), stroke="#999", stroke_dasharray="2 3"),
        _svg("rect", x=left, y=top, width=w, height=h, fill="none", stroke="#444"),
    ]
    parts += [_svg("text", f"{v:g}", x=x(v), y=top + h + 16, text_anchor="middle") for v in _ticks(0, x_max)]
    parts += [_svg("text", f"{v:g}", x=left - 6, y=y(v) + 4, text_anchor="end") for v in _ticks(y_min, y_max)]
    front = sorted((r for r in done if r["task"] in best), key=lambda r: r["program_mb"])
    if len(front) > 1:
        points = " ".join(f"{x(r['program_mb']):.1f},{y(r['perplexity_change_pct']):.1f}" for r in front)
        parts.append(_svg("polyline", points=points, fill="none", stroke="#c0392b", stroke_dasharray="5 3"))
    for r in done:
        speed = r.get("decode_tokens_per_s")
        fill = _colour((speed - lo) / (hi - lo) if hi > lo else 1.0) if speed else "#bbb"
        cx, cy = x(r["program_mb"]), y(r["perplexity_change_pct"])
        edge = {"stroke": "#c0392b", "stroke_width": 2} if r["task"] in best else {"stroke": "#333"}
        parts.append(_svg("circle", cx=cx, cy=cy, r=6, fill=fill, **edge))
        parts.append(_svg("text", r["variant"], x=cx + 8, y=cy - 6))
    parts.append(_svg("text", "program size (MB)", x=left + w / 2, y=height - 8, text_anchor="middle"))
    turned = f"translate(14 {top + h / 2:.1f}) rotate(-90)"
    parts.append(_svg("text", "perplexity change (%)", transform=turned, text_anchor="middle"))
    parts.append(_legend(left + w + 24, top, h, lo, hi))
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' font-size='11' "
        "font-family='sans-serif'>" + "".join(parts) + "</svg><p>Each point a program; ◆ and the dashed line: "
        "the Pareto front (no other program is both smaller and closer to float); colour: decode speed.</p>"
    )


def _legend(x0: float, top: float, h: float, lo: float, hi: float) -> str:
    steps = 20
    bands = [
        _svg(
            "rect",
            x=x0,
            y=top + h * (1 - (i + 1) / steps),
            width=14,
            height=h / steps + 0.5,
            fill=_colour((i + 0.5) / steps),
        )
        for i in range(steps)
    ]
    labels = [(f"{hi:.1f}", top + 10), ("decode", top + h / 2), ("tok/s", top + h / 2 + 13), (f"{lo:.1f}", top + h)]
    return "".join(bands + [_svg("text", text, x=x0 + 18, y=y) for text, y in labels])


def _svg(tag: str, text: str | None = None, **attributes) -> str:
    """An SVG element, valid XML (the chart can be cut out of the page); numbers to 0.1."""
    values = {k.replace("_", "-"): f"{v:.1f}" if isinstance(v, float) else v for k, v in attributes.items()}
    attrs = " ".join(f"{k}='{html.escape(str(v))}'" for k, v in values.items())
    return f"<{tag} {attrs}/>" if text is None else f"<{tag} {attrs}>{html.escape(text)}</{tag}>"


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round values between lo and hi, about `count` of them."""
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step *= next(m for m in (1, 2, 5, 10) if m * step >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step) + 1)]
