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


def test_a_table_in_parts_is_dequantized_at_the_rows_read_only():
    """As above, for a table whose first rows are at 8 bits (models/table_parts.py): each id's row
    from the part that holds it."""
    import torch
    from conftest import REFERENCE

    from genai_pipeline.checkpoints.hf import open_decoder
    from genai_pipeline.evaluate.text import _embedded
    from genai_pipeline.options import QuantOptions
    from genai_pipeline.quantize.streaming import quantize_blocks
    from genai_pipeline.registry import get_spec

    decoder, loader = open_decoder(get_spec("reference"), REFERENCE, 64)
    options = QuantOptions(recipe="8da4w", weight_rule="mse", head="8da4w", smooth=None, table_8bit_rows=1000)
    quantize_blocks(decoder, loader, options)
    tokens = [5, 999, 1000, 5, 4095, 1001, 0]
    assert torch.equal(_embedded(decoder, tokens), decoder.embed(torch.tensor([tokens])))
