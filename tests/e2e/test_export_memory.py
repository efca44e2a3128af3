"""An export's peak memory, measured on child processes: the default 4-bit recipe (rotation,
smoothing, GPTQ, verification and report) holds less than the float export of the same checkpoint,
which holds the float model once. Before the export streamed the model block by block it held the
float model, every layer's Hessian and two more float models for verification and report, and
needed ~2.3x the float export's memory on this checkpoint."""

import json
import os
import resource
import subprocess
import sys

import pytest
from conftest import REPO

from bench.export_scale import COMMON, SMOLLM2_GGUF, _shape, write_tokenizer, write_weights

# Weights dominate the process: 4 blocks of a 1B-wide model and SmolLM2's vocabulary (a 200 MB
# table), 0.43 GB in float32; GPTQ's w2 Hessians are 64 MB each.
SHAPE = _shape(2, 1024, 4096, 16, 4, 49152, True, 32.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    if not SMOLLM2_GGUF.is_file():
        pytest.skip("SmolLM2's GGUF (the tokenizer) is fetched by `make test`")
    folder = tmp_path_factory.mktemp("wide") / "checkpoint"
    folder.mkdir()
    config = {**COMMON, **SHAPE, **write_tokenizer(folder, SMOLLM2_GGUF)}
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
    assert quant_peak < float_peak, (quant_peak, float_peak)
