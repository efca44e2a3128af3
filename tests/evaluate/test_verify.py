"""Every quantized export ends verified: the program against its float model, on held-out text."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from genai_pipeline.cli import main
from genai_pipeline.evaluate.verify import Verification, held_out_text, warning
from genai_pipeline.quantize import streaming


def export(out, *options) -> str:
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stderr", err)
        code = main(["export", "reference", "--mode", "kv", "--max-seq-len", "128", "--out", str(out), *options])
    assert code == 0, err.getvalue()
    return err.getvalue()


def test_a_quantized_export_records_its_verification(tmp_path):
    stderr = export(tmp_path / "q", "--recipe", "8da8w")
    verification = json.loads((tmp_path / "q" / "manifest.json").read_text())["verification"]
    assert verification["tokens"] == 254 and "built-in English prose" in verification["text"]  # 2 windows of 128
    assert abs(verification["perplexity_change"]) < 0.02 and verification["top1_agreement"] > 0.9
    assert verification["warning"] is None and "WARNING" not in stderr
    assert "verified on 254 tokens" in stderr
    assert "The program, verified on" in (tmp_path / "q" / "quant_report.html").read_text()


def test_a_broken_recipe_trips_the_warning(tmp_path, monkeypatch):
    real = streaming.quantize_linears

    def broken(module, linears, *args, **kwargs):  # the rows of every down projection shuffled before quantizing
        with torch.no_grad():
            for name in linears:
                if name.endswith("feed_forward.w2"):
                    w = module.get_submodule(name).weight
                    w.copy_(w[torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(0))])
        return real(module, linears, *args, **kwargs)

    monkeypatch.setattr(streaming, "quantize_linears", broken)
    stderr = export(tmp_path / "broken", "--recipe", "8da8w")
    verification = json.loads((tmp_path / "broken" / "manifest.json").read_text())["verification"]
    assert verification["perplexity_change"] > 0.25
    assert "WARNING: this program loses" in stderr and "try --recipe fp32" in stderr
    assert "Warning:" in (tmp_path / "broken" / "quant_report.html").read_text()


def test_thresholds_and_the_held_out_text(tmp_path):
    good = Verification("t", 100, 20.0, 21.0, 0.9, 0.05)
    assert warning(good, "8da4w-g32+emb8w") is None
    four_bit = warning(Verification("t", 100, 20.0, 30.0, 0.9, 0.05), "8da4w-g32+emb8w")
    assert r"try --quant-override '^layers\.=8da8w' (every block's linears at 8 bits) or --recipe 8da8w" in four_bit
    top1_alone = warning(Verification("t", 100, 20.0, 19.8, 0.5, 0.05), "8da8w")  # perplexity even improved
    assert (
        top1_alone.startswith("this program loses 50 % of its float model's next tokens against")
        and "-1.0 %" in top1_alone
    )
    long_text = tmp_path / "calib.txt"
    long_text.write_text("a" * 20000 + "the held-out tail")
    text, source = held_out_text([long_text])
    assert text.endswith("the held-out tail") and source == "the tail of calib.txt"
    (tmp_path / "short.txt").write_text("all of it is calibration")
    assert "built-in" in held_out_text([tmp_path / "short.txt"])[1]
