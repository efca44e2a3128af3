"""An export's peak memory, measured on child processes: the default 4-bit recipe (rotation,
smoothing, GPTQ, verification and report) holds less than the float export of the same checkpoint,
which holds the float model once. Before the export streamed the model block by block it held the
float model, every layer's Hessian and two more float models for verification and report."""

import json
import os
import resource
import shutil
import subprocess
import sys

import pytest
from conftest import REFERENCE, REPO

from bench.export_scale import COMMON, _shape, write_weights

# The blocks dominate the process: 4 blocks of a 1B-wide model (the reference model's tokenizer and
# vocabulary of 4096), 0.25 GB in float32; GPTQ's w2 Hessians are 64 MB each.
SHAPE = _shape(4, 1024, 4096, 16, 4, 4096, True, 32.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wide") / "checkpoint"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(REFERENCE / name, folder / name)
    config = {**COMMON, **SHAPE, "bos_token_id": 0, "eos_token_id": 0}
    (folder / "config.json").write_text(json.dumps(config))
    write_weights(folder, config, seed=0, shard_bytes=64 << 20)
    return folder


def peak_rss_mb(*args: str) -> float:
    """The peak RSS of `genai export ARGS` in a child process of its own."""
    code = (
        "import resource, sys; from genai_pipeline.cli import main; rc = main(sys.argv[1:]); "
        "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(rc)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", code, "export", *args], capture_output=True, text=True, env=env, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split("PEAK")[-1]) / 1024


@pytest.mark.xdist_group("export_memory")
def test_a_calibrated_4_bit_export_holds_less_than_the_float_export(checkpoint, tmp_path):
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0  # Linux reports it
    float_peak = peak_rss_mb("--checkpoint", str(checkpoint), "--recipe", "fp32", "--out", str(tmp_path / "fp32"))
    quant_peak = peak_rss_mb("--checkpoint", str(checkpoint), "--recipe", "8da4w", "--out", str(tmp_path / "q"))
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert manifest["verification"]["tokens"] > 0  # verified and reported, as every export is
    assert {s["name"] for s in manifest["export_stages"]["stages"]} >= {"load", "calibrate", "gptq", "lower", "verify"}
    print("PEAKS", quant_peak, float_peak)
    assert quant_peak < float_peak, (quant_peak, float_peak)
