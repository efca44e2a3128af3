"""Exports that cannot calibrate: random weights (a registry name without a checkpoint) take the
recipe without calibration, said on one line; a checkpoint without a tokenizer is refused before
any work, naming --no-calibration."""

import dataclasses
import json

import pytest
from conftest import save_hf_checkpoint

from genai_pipeline.checkpoints.hf import random_decoder
from genai_pipeline.cli import main
from genai_pipeline.errors import InputError
from genai_pipeline.options import CalibrationOptions, QuantOptions, quant_options_from
from genai_pipeline.quantize.calibration import calibrating, calibration_free
from genai_pipeline.quantize.recipes import linear_recipes
from genai_pipeline.registry import SPECS, get_spec


def test_a_registry_name_without_a_checkpoint_exports_the_default_recipe(capsys, tmp_path, monkeypatch):
    """`genai export NAME --recipe 8da4w` for an entry without shipped weights (random weights, no
    tokenizer): GPTQ and SmoothQuant dropped, said on one line naming the fix; the program's layers
    are the calibrated recipe's. The entry: the reference model's sizes without its weights (a
    real entry such as stories15m costs three times as long to lower)."""
    spec = dataclasses.replace(get_spec("reference"), name="reference-unshipped", checkpoint=None)
    monkeypatch.setitem(SPECS, spec.name, spec)
    out = tmp_path / "out"
    argv = ["export", spec.name, "--recipe", "8da4w", "--mode", "kv", "--max-seq-len", "32", "--out", str(out)]
    assert main(argv) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "no tokenizer to calibrate with" in line]
    assert len(said) == 1, said
    assert "without GPTQ or SmoothQuant" in said[0] and "--checkpoint DIR" in said[0] and "--no-calibration" in said[0]
    manifest = json.loads((out / "manifest.json").read_text())
    quant = quant_options_from(manifest["quantization"])
    assert (manifest["weights"], quant.weight_rule, quant.smooth, quant.rotate) == ("random", "mse", None, True)
    assert manifest["recipe"].startswith("8da4w-g32-mse-rot+")
    # the same linears at the same widths as the full recipe (GPTQ's head at 4 bits too): its size and speed
    decoder = random_decoder(spec.config, 32, 0)
    assert linear_recipes(decoder, quant) == linear_recipes(decoder, QuantOptions(recipe="8da4w"))
    assert sorted(manifest["files"]) == ["quant_report.html", "text_decoder.pte"]


def test_a_checkpoint_without_a_tokenizer_is_refused_before_any_work(capsys, tmp_path):
    checkpoint = save_hf_checkpoint(tmp_path / "ckpt")  # weights and config.json, no tokenizer
    out = tmp_path / "out"
    assert main(["export", "--checkpoint", str(checkpoint), "--recipe", "8da4w", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --recipe 8da4w calibrates on text (GPTQ, SmoothQuant)"), err
    assert "--no-calibration" in err[-1]
    assert not any(line.startswith("genai: prepare") for line in err), err  # nothing was loaded
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
    # random weights with what needs calibration text: refused before any work too
    for flags, named in ((["--size-budget", "5"], "--size-budget"), (["--calib", "random"], "--calib")):
        assert main(["export", "stories15m", "--recipe", "8da4w", *flags, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith(f"error: {named} measures on calibration text"), err
        assert "--checkpoint DIR" in err[-1] and not any("prepare" in line for line in err), err
    assert not out.exists()


def test_calibration_free_keeps_the_layers_and_refuses_what_must_calibrate():
    free = calibration_free(QuantOptions(recipe="8da4w"))
    assert (free.weight_rule, free.smooth, free.head) == ("mse", None, "8da4w") and calibrating(free) == ()
    assert calibrating(QuantOptions(recipe="8da4w")) == ("GPTQ", "SmoothQuant")
    assert calibrating(QuantOptions(recipe="8da8w")) == ("SmoothQuant",)
    assert calibration_free(QuantOptions(recipe="8da8w")).head == "auto"  # its head rule is unchanged
    assert calibration_free(QuantOptions(recipe="8da4w", weight_rule="q4_0")).weight_rule == "q4_0"
    with pytest.raises(InputError, match="calibrates by definition"):
        calibration_free(QuantOptions(recipe="8a8w"))
    with pytest.raises(InputError, match="--calib measures on calibration text"):
        calibration_free(QuantOptions(recipe="8da4w", calibration=CalibrationOptions(datasets=("random",))))
