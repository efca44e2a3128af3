import re

from conftest import Q4, copy_export

from genai_pipeline.evaluate.report import write_quant_report
from genai_pipeline.evaluate.text import block_outputs, float_model, layer_sqnr, quantized_model
from genai_pipeline.manifest import Manifest


def test_report_quantizing_in_place_matches_a_separate_copy(tmp_path, export_reference):
    folder = copy_export(export_reference("kv", Q4), tmp_path / "export")
    tokens = list(range(1, 65))
    html = write_quant_report(folder, tokens, "test tokens").read_text()  # its QDQ blocks read from files
    assert not list(folder.glob(".*weights"))  # unlinked once mapped
    shown = {
        f"layers.{i}": float(db) for i, db in re.findall(r"<td>layers\.(\d+)</td><td class=num>([\d.]+)</td>", html)
    }

    manifest = Manifest.read(folder)
    reference = float_model(manifest)
    qdq = quantized_model(folder, manifest, reference)  # a copy: the reference stays float
    want = layer_sqnr(block_outputs(reference, tokens), block_outputs(qdq, tokens))
    assert shown == want and len(want) == manifest.config.n_layers
    assert all(5 < db < 60 for db in want.values())  # quantized, so finite noise, and not garbage


def test_quantized_table_is_dequantized_at_the_rows_read_only(tmp_path, export_reference):
    """The report's QDQ lookup gives what torchao's whole-table lookup gives, bit for bit, the
    embedding's scaling included (a Q4 export: the table is int4 by group)."""
    import torch

    from genai_pipeline.evaluate.text import _embedded

    folder = export_reference("kv", Q4)
    manifest = Manifest.read(folder)
    qdq = quantized_model(folder, manifest, float_model(manifest))
    assert type(qdq.tok_embeddings.weight) not in (torch.Tensor, torch.nn.Parameter)  # torchao's
    tokens = [5, 3, 5, 900, 0, 3]
    assert torch.equal(_embedded(qdq, tokens), qdq.embed(torch.tensor([tokens])))
    assert qdq.tok_embeddings.weight.shape[0] == manifest.config.vocab_size  # the whole table is back
