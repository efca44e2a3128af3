"""The export folder holds what deploys: what `genai eval` rebuilds the QDQ model with (GPTQ's int4
weights, the smoothing factors) is kept in the QDQ cache, keyed by the program's digest, and chosen
again from the checkpoint where the cache has none."""

import json

import pytest
import torch
from conftest import Q4, REFERENCE, copy_export

from genai_pipeline.cli import main
from genai_pipeline.errors import InputError
from genai_pipeline.evaluate.chosen import chosen_values
from genai_pipeline.export_folder import int4_file, smoothing_file
from genai_pipeline.manifest import Manifest
from genai_pipeline.names import ArtifactKey
from genai_pipeline.quantize import qdq_cache
from genai_pipeline.quantize.weights import packed_int4


def _eval(capsys, folder) -> tuple[dict, list[str]]:
    argv = ["eval", str(folder), "--text", str(REFERENCE / "heldout.txt"), "--max-tokens", "160", "--json"]
    assert main(argv) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err.splitlines()


def _equal(a: qdq_cache.Chosen, b: qdq_cache.Chosen) -> bool:
    return (
        a.int4.keys() == b.int4.keys()
        and all(torch.equal(a.int4[k][i], b.int4[k][i]) for k in a.int4 for i in (0, 1))
        and a.smoothing.keys() == b.smoothing.keys()
        and all(torch.equal(a.smoothing[k], b.smoothing[k]) for k in a.smoothing)
    )


def test_eval_rebuilds_the_qdq_model_from_the_cache_and_chooses_again_without_it(capsys, tmp_path, export_reference):
    folder = export_reference("kv", Q4)  # GPTQ and smoothing on the reference model's checkpoint
    manifest = Manifest.read(folder)
    names = sorted(p.name for p in folder.iterdir())
    assert not [n for n in names if n.endswith((".int4.pt", ".smoothing.pt"))], names
    assert sorted(manifest.files) == [n for n in names if n != "manifest.json"]
    assert manifest.artifacts[ArtifactKey.TEXT_DECODER].chosen == ("int4", "smoothing")
    entry = qdq_cache.entry_file(manifest.files["text_decoder.pte"].sha256)
    kept = qdq_cache.load(manifest.files["text_decoder.pte"].sha256)
    assert entry.is_file() and len(kept.int4) > 0 and len(kept.smoothing) > 0

    # the figures of a folder that holds them as exports of earlier versions did
    old = copy_export(folder, tmp_path / "old")
    torch.save(packed_int4(kept.int4), int4_file(old, "text_decoder"))
    torch.save(kept.smoothing, smoothing_file(old, "text_decoder"))
    entry.unlink()
    before, _ = _eval(capsys, old)
    assert not entry.exists()  # read from the folder, not chosen again
    assert before["perplexity"]["qdq"] < 1.05 * before["perplexity"]["float"]  # GPTQ's weights, not mse's

    qdq_cache.store(manifest.files["text_decoder.pte"].sha256, kept)
    cached, err = _eval(capsys, folder)
    assert cached == before and not [line for line in err if "QDQ cache" in line]

    entry.unlink()  # the folder on another machine, or the cache cleared
    again, err = _eval(capsys, folder)
    said = [line for line in err if "not in the QDQ cache" in line]
    assert len(said) == 1 and "choosing them again from" in said[0] and str(REFERENCE) in said[0], err
    assert again == before
    assert _equal(qdq_cache.load(manifest.files["text_decoder.pte"].sha256), kept)  # bit for bit, and stored


def test_without_the_cache_entry_or_the_checkpoint_eval_says_so_in_one_line(capsys, tmp_path, export_reference):
    folder = copy_export(export_reference("kv", Q4), tmp_path / "moved")
    capsys.readouterr()  # the export's progress, where this test is the first to ask for it
    data = json.loads((folder / "manifest.json").read_text())
    data["checkpoint"]["path"] = data["weights"] = str(tmp_path / "gone")
    data["files"]["text_decoder.pte"]["sha256"] = "f" * 64  # no cache entry under it
    (folder / "manifest.json").write_text(json.dumps(data))
    assert main(["eval", str(folder), "--text", str(REFERENCE / "heldout.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: the checkpoint {tmp_path / 'gone'} the export was made from is gone (its float model is "
                   "rebuilt from it): put it back there, or re-export"], err  # fmt: skip
    with pytest.raises(InputError, match=r"int4 weights and smoothing factors of text_decoder.pte are not in the QDQ"):
        chosen_values(folder, Manifest.read(folder), ArtifactKey.TEXT_DECODER)
