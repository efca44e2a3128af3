"""quant_report.html: after a quantized export, each layer's output SQNR (QDQ vs float) as a bar
chart, so a user sees at a glance which layer hurts. Self-contained HTML, no plotting library."""

from __future__ import annotations

import html
from pathlib import Path

from genai_pipeline.evaluate.text import block_outputs, float_model, layer_sqnr, quantized_model
from genai_pipeline.export_folder import atomic_write, check_weights
from genai_pipeline.manifest import Manifest
from genai_pipeline.models.cache_io import CacheIOContract

REPORT = "quant_report.html"
# Below this a layer's output noise is large enough to show in perplexity (see genai eval).
WARN_DB = 20.0


def write_quant_report(folder: Path, tokens: list[int], source: str, verification=None) -> Path:
    """quant_report.html in the export folder `folder` (before it is published), listed in its
    manifest. `source` says what the tokens are; `verification` (verify.Verification): the
    program's own figures against float, shown above the per-layer chart."""
    manifest = Manifest.read(folder)
    check_weights(manifest.checkpoint)
    model = float_model(manifest)
    want = block_outputs(model, tokens)
    # The float model turns into the QDQ one in place: one copy of the weights in memory, not two
    # (a 1B model's are 5 GB in fp32); its blocks go to memory-mapped files as they are quantized,
    # read back one at a time by the forward (an 8B model's int8 weights are 7.5 GB).
    qdq = quantized_model(folder, manifest, model, in_place=True, weights_folder=folder)
    sqnr = layer_sqnr(want, block_outputs(qdq, tokens, CacheIOContract.from_manifest(manifest)))
    path = Path(folder) / REPORT
    data = f"{len(tokens)} tokens of {source}"
    if manifest.vision is not None:
        data += "; the image tower's layers and connector over a synthetic test image (evaluate.report_image)"
    atomic_write(path, render(manifest, sqnr, data, verification))
    manifest.with_file(folder, REPORT).write(folder)
    return path


def render(manifest: Manifest, sqnr: dict[str, float], data: str, verification=None) -> str:
    worst = min(sqnr, key=sqnr.get) if sqnr else None
    top = max([v for v in sqnr.values() if v != float("inf")] + [1.0])
    rows = []
    for layer, db in sqnr.items():
        width = 100 * min(db, top) / top
        color = "#c0392b" if db < WARN_DB else ("#e67e22" if layer == worst else "#2e86c1")
        rows.append(
            f"<tr><td>{html.escape(layer)}</td><td class=num>{db:.2f}</td>"
            f"<td><div class=bar style='width:{width:.1f}%;background:{color}'></div></td></tr>"
        )
    title = f"{manifest.model} — {manifest.recipe} on {manifest.target}"
    return f"""<!doctype html>
<meta charset=utf-8>
<title>{html.escape(title)}</title>
<style>
body{{font-family:sans-serif;max-width:52em;margin:2em auto}} td{{padding:2px 8px}}
.num{{text-align:right;font-variant-numeric:tabular-nums}} .bar{{height:1em}} td:last-child{{width:60%}}
</style>
<h1>{html.escape(title)}</h1>
{_verification_html(verification)}
<p>Signal-to-quantization-noise ratio of each block's output, quantized model vs float, over
{html.escape(data)}. Higher is better; below {WARN_DB:.0f} dB is red.
Worst layer: <b>{html.escape(worst or "n/a")}</b>. For perplexity, top-1 agreement and KL on
your own text run <code>genai eval</code>.</p>
<table><tr><th>layer<th>SQNR dB<th></tr>
{chr(10).join(rows)}
</table>
"""


def _verification_html(verification) -> str:
    if verification is None:
        return "<p>The program was not verified against its float model (no tokenizer).</p>"
    warning = (
        f"<p style='color:#c0392b'><b>Warning:</b> {html.escape(verification.warning)}</p>"
        if verification.warning
        else ""
    )
    return f"<p><b>The program, {html.escape(verification.line())}.</b></p>{warning}"
