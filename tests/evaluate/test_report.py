import re

from conftest import Q4, copy_export

from genai_pipeline.bundle import read_manifest
from genai_pipeline.evaluate.report import write_quant_report
from genai_pipeline.evaluate.text import block_outputs, float_model, layer_sqnr, quantized_model


def test_report_quantizing_in_place_matches_a_separate_copy(tmp_path, export_reference):
    folder = copy_export(export_reference("kv", Q4), tmp_path / "export")
    tokens = list(range(1, 65))
    html = write_quant_report(folder, tokens, "test tokens").read_text()
    shown = {
        f"layers.{i}": float(db) for i, db in re.findall(r"<td>layers\.(\d+)</td><td class=num>([\d.]+)</td>", html)
    }

    manifest = read_manifest(folder)
    reference = float_model(manifest)
    qdq = quantized_model(folder, manifest, reference)  # a copy: the reference stays float
    want = layer_sqnr(block_outputs(reference, tokens), block_outputs(qdq, tokens))
    assert shown == want and len(want) == manifest["config"]["n_layers"]
    assert all(5 < db < 60 for db in want.values())  # quantized, so finite noise, and not garbage
