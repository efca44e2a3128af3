"""genai eval: perplexities against the float model, top-1 agreement and KL."""

import json

from conftest import Q4, REFERENCE

from genai_pipeline.cli import main


def _eval(capsys, folder, *extra):
    assert main(["eval", str(folder), "--text", str(REFERENCE / "heldout.txt"), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_float_program_scores_like_its_eager_model(capsys, export_tiny):
    result = _eval(capsys, export_tiny("hybrid"), "--max-tokens", "300", "--window", "40")
    ppl = result["perplexity"]
    assert (
        ppl["qdq"] is None and result["tokens"] == 300 - 8
    )  # 8 windows of 40 and one of 20, each loses its first token
    assert abs(ppl["program"] / ppl["float"] - 1) < 1e-3
    assert result["top1_agreement"] > 0.99 and result["kl_divergence"] < 1e-4
    # prefill, scored at the end of each whole chunk of 8 with a next token to predict: 4 in each of the 7
    # windows of 40 (the 5th chunk ends on the window's last token), 2 in the last window of 20
    assert result["prefill"]["positions"] == 7 * 4 + 2
    assert result["prefill"]["top1_agreement"] == 1.0 and result["prefill"]["kl_divergence"] < 1e-4


def test_kv_mode_scores_the_same_tokens_as_hybrid(capsys, export_tiny):
    hybrid = _eval(capsys, export_tiny("hybrid"), "--max-tokens", "120")
    kv = _eval(capsys, export_tiny("kv"), "--max-tokens", "120")
    assert "prefill" in hybrid and "prefill" not in kv  # a kv program has no prefill method
    assert abs(hybrid["perplexity"]["program"] / kv["perplexity"]["program"] - 1) < 1e-3


def test_8da4w_reference_stays_within_5_percent_of_float(capsys, export_reference):
    result = _eval(capsys, export_reference("hybrid", Q4), "--max-tokens", "2048")
    ppl = result["perplexity"]
    assert ppl["float"] < 400  # the shipped model has learned something (uniform: 4096)
    assert ppl["program"] <= 1.05 * ppl["float"] and ppl["qdq"] <= 1.05 * ppl["float"]
    assert result["top1_agreement"] > 0.85
    assert set(result["layer_sqnr_db"]) == {f"layers.{i}" for i in range(4)}
    assert all(db > 15 for db in result["layer_sqnr_db"].values())
