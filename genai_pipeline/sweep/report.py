"""A sweep's results: sweep.json (a row per task) and report.html, a self-contained page (inline
SVG, no script, no plotting library) with, per model, the Pareto chart of accuracy change against
program size coloured by decode speed, the table with its Pareto-optimal rows marked, and a
recommendation line per size class.

Each model is charted and judged on its own, by its own accuracy: a text model by its perplexity
change on the evaluation text, a vision-language model by its answer perplexity change on the image
questions (its answers go through the image tower and the decoder, what the text alone misses)."""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass
from pathlib import Path

from genai_pipeline.export_folder import atomic_write
from genai_pipeline.sweep.spec import Report

SWEEP_JSON = "sweep.json"
REPORT = "report.html"
# Decode speed, slow to fast: a perceptually ordered ramp (viridis' ends and middle), readable in grey.
RAMP = ((68, 1, 84), (33, 145, 140), (253, 231, 37))


@dataclass(frozen=True)
class Accuracy:
    """How a model's programs are judged: a row's change against float, in %."""

    key: str  # the row's field
    name: str  # what it is, in the report's words
    digits: int  # shown after the point (answers are often within a thousandth of float's)


PERPLEXITY = Accuracy("perplexity_change_pct", "perplexity", 2)
ANSWERS = Accuracy("answer_perplexity_change_pct", "answer perplexity", 3)


def accuracy_of(rows: list[dict]) -> Accuracy:
    """A vision-language model's rows (they carry image-question figures) by their answers, else by perplexity."""
    return ANSWERS if any(ANSWERS.key in r for r in rows) else PERPLEXITY


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


def pareto(rows: list[dict], accuracy: Accuracy = PERPLEXITY) -> set[str]:
    """The tasks no other row beats on both program size and accuracy change."""
    done = [r for r in rows if r.get("status") == "done"]
    change = accuracy.key

    def beats(a, b):
        return (
            a["program_mb"] <= b["program_mb"]
            and a[change] <= b[change]
            and (a["program_mb"] < b["program_mb"] or a[change] < b[change])
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


def recommendations(rows: list[dict], options: Report, accuracy: Accuracy = PERPLEXITY) -> list[str]:
    """One line for the tolerance (max_perplexity_change, on the rows' accuracy), one per size class."""
    done = [r for r in rows if r.get("status") == "done"]
    if not done:
        return ["no task finished: nothing to recommend"]
    tolerance = options.max_perplexity_change
    within = [r for r in done if r[accuracy.key] <= tolerance]
    lines = [
        f"smallest program within +{tolerance:g} % {accuracy.name}: "
        + (_describe(min(within, key=lambda r: r["program_mb"]), accuracy) if within else "none")
    ]
    for limit in size_classes(rows, options):
        fits = [r for r in done if r["program_mb"] <= limit]
        best = min(fits, key=lambda r: r[accuracy.key]) if fits else None
        lines.append(
            f"up to {limit:g} MB: "
            + (f"lowest {accuracy.name} change: {_describe(best, accuracy)}" if best else "none fits")
        )
    return lines


def _describe(row: dict, accuracy: Accuracy) -> str:
    answers = (
        f", exact match {100 * row['exact_match']:.1f} % (float {100 * row['float_exact_match']:.1f} %)"
        if accuracy is ANSWERS
        else ""
    )
    speed = f", {row['decode_tokens_per_s']:.1f} tok/s decode" if row.get("decode_tokens_per_s") else ""
    return f"{row['variant']} ({row['program_mb']:.1f} MB, {row[accuracy.key]:+.{accuracy.digits}f} %{answers}{speed})"


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
{machine_line} Perplexity change: the program's perplexity over its float model's on the evaluation text.{
        IMAGES_NOTE if any(ANSWERS.key in r for r in rows) else ""
    }</p>
{"".join(sections)}
"""


IMAGES_NOTE = (
    " Answer perplexity change (a vision-language model's accuracy): the same for the expected answers"
    " of the image questions, which go through the image tower and the decoder; exact match: the greedy"
    " answers that equal the expected ones; = float: those that equal the float model's."
)


def _model_section(model: str, rows: list[dict], options: Report) -> str:
    accuracy = accuracy_of(rows)
    best = pareto(rows, accuracy)
    lines = "".join(f"<li>{html.escape(line)}</li>" for line in recommendations(rows, options, accuracy))
    columns = IMAGE_COLUMNS if accuracy is ANSWERS else TEXT_COLUMNS
    body = "\n".join(_table_row(r, r["task"] in best, columns) for r in rows)
    header = "".join(f"<th>{name}" for name, _ in columns)
    return f"""<h2>{html.escape(model)}</h2>
{_chart(rows, best, accuracy)}
<ul>{lines}</ul>
<table><tr><th>variant<th>recipe<th>mode{header}<th>Pareto</tr>
{body}
</table>
"""


def _number(key: str, form: str, scale: float = 1.0):
    """A column's cell: the row's `key` formatted, n/a where the row has none."""
    return lambda r: "n/a" if r.get(key) is None else format(scale * r[key], form)


_EXPORT_COLUMNS = (
    ("decode tok/s", _number("decode_tokens_per_s", ".1f")),
    ("prefill tok/s", _number("prefill_tokens_per_s", ".1f")),
    ("peak RSS MB", _number("peak_rss_mb", ".0f")),
    ("export min", _number("export_minutes", ".1f")),
    ("export RSS MB", _number("export_peak_rss_mb", ".0f")),
)
# (header, cell) after variant, recipe and mode
TEXT_COLUMNS = (
    ("program MB", _number("program_mb", ".2f")),
    ("perplexity", _number("perplexity", ".3f")),
    ("change %", _number("perplexity_change_pct", "+.2f")),
    ("KL", _number("kl_divergence", ".5f")),
    ("top-1 %", _number("top1_agreement", ".2f", 100)),
    *_EXPORT_COLUMNS,
)
IMAGE_COLUMNS = (
    ("program MB", _number("program_mb", ".2f")),
    ("answer perplexity", _number("answer_perplexity", ".4f")),
    ("change %", _number("answer_perplexity_change_pct", "+.3f")),
    ("exact match %", lambda r: f"{100 * r['exact_match']:.1f} (float {100 * r['float_exact_match']:.1f})"),
    ("= float %", _number("answers_agree", ".1f", 100)),
    ("text perplexity change %", _number("perplexity_change_pct", "+.2f")),
    ("image encode ms", _number("image_encode_ms", ".2f")),
    ("first token ms", _number("time_to_first_token_ms", ".2f")),
    *_EXPORT_COLUMNS,
)


def _table_row(r: dict, optimal: bool, columns: tuple) -> str:
    name = html.escape(r["variant"])
    if r.get("status") != "done":
        return f"<tr><td>{name}<td colspan={len(columns) + 3} class=err>failed: {html.escape(r.get('error', ''))}</tr>"
    tds = "".join(f"<td class=num>{cell(r)}" for _, cell in columns)
    mark = "◆" if optimal else ""
    return (
        f"<tr{' class=pareto' if optimal else ''}><td>{name}<td>{html.escape(r['recipe'])}<td>{html.escape(r['mode'])}"
        f"{tds}<td>{mark}</tr>"
    )


def _colour(t: float) -> str:
    """A point of RAMP, t in [0, 1]."""
    t = min(max(t, 0.0), 1.0) * (len(RAMP) - 1)
    i = min(int(t), len(RAMP) - 2)
    a, b = RAMP[i], RAMP[i + 1]
    return "#" + "".join(f"{round(x + (y - x) * (t - i)):02x}" for x, y in zip(a, b))


def _chart(rows: list[dict], best: set[str], accuracy: Accuracy, width: int = 640, height: int = 340) -> str:
    done = [r for r in rows if r.get("status") == "done"]
    if not done:
        return ""
    left, right, top, bottom = 60, 110, 20, 45
    w, h = width - left - right, height - top - bottom
    x_max = max(r["program_mb"] for r in done) * 1.08
    y_values = [r[accuracy.key] for r in done]
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
        points = " ".join(f"{x(r['program_mb']):.1f},{y(r[accuracy.key]):.1f}" for r in front)
        parts.append(_svg("polyline", points=points, fill="none", stroke="#c0392b", stroke_dasharray="5 3"))
    for r in done:
        speed = r.get("decode_tokens_per_s")
        fill = _colour((speed - lo) / (hi - lo) if hi > lo else 1.0) if speed else "#bbb"
        cx, cy = x(r["program_mb"]), y(r[accuracy.key])
        edge = {"stroke": "#c0392b", "stroke_width": 2} if r["task"] in best else {"stroke": "#333"}
        parts.append(_svg("circle", cx=cx, cy=cy, r=6, fill=fill, **edge))
        parts.append(_svg("text", r["variant"], x=cx + 8, y=cy - 6))
    parts.append(_svg("text", "program size (MB)", x=left + w / 2, y=height - 8, text_anchor="middle"))
    turned = f"translate(14 {top + h / 2:.1f}) rotate(-90)"
    parts.append(_svg("text", f"{accuracy.name} change (%)", transform=turned, text_anchor="middle"))
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
