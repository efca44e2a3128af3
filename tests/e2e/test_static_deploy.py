"""A static recipe's deploy graphs keep the next-token-only contract: calibration sees every
position, the program's methods return [1, vocab] and run the QDQ model they were lowered from."""

import json
import os
import stat

import torch
from conftest import TINY_VOCAB

from genai_pipeline.cli import main
from genai_pipeline.options import SamplingOptions
from genai_pipeline.runtime.generate import Sampler, generate
from genai_pipeline.runtime.program import load_program
from genai_pipeline.runtime.session import DecoderSession, EagerSession

PROMPT = torch.randint(1, TINY_VOCAB, (19,), generator=torch.Generator().manual_seed(5)).tolist()  # 2 chunks + 3


def test_hybrid_8a8w_program_returns_the_next_token_only_and_matches_its_qdq_model(capsys, tmp_path, tiny_checkpoint):
    out = tmp_path / "8a8w"
    argv = [
        "export",
        "--checkpoint",
        str(tiny_checkpoint),
        "--mode",
        "hybrid",
        "--recipe",
        "8a8w",
        "--calib",
        "random",
        "--calib-limit",
        "2",
        "--calib-seq-len",
        "16",
        "--max-seq-len",
        "64",
        "--prefill-len",
        "8",
        "--long-prefill-len",
        "0",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "calibrating text_decoder on RANDOM tokens" in err  # a static recipe really calibrates on them

    program = load_program(out / "text_decoder.pte")
    for method in ("prefill_chunk", "decode_token"):
        assert list(program.metadata(method).output_tensor_meta(0).sizes()) == [1, TINY_VOCAB], method

    qdq = torch.export.load(out / "text_decoder.qdq.pt2").module()
    assert qdq(torch.tensor([PROMPT[:8]]), torch.tensor([0])).shape == (
        1,
        8,
        TINY_VOCAB,
    )  # calibrated on every position
    greedy = Sampler(SamplingOptions(temperature=0))
    ours = generate(DecoderSession(out), PROMPT, 16, greedy)
    eager = generate(EagerSession(qdq, 64), PROMPT, 16, greedy)
    assert ours.tokens == eager.tokens

    # the folder keeps the calibrated model for a re-run to reuse (its reuse: tests/quantize/test_quantize.py's
    # QNN export, which re-runs without lowering)
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"quant_report.html", "text_decoder.qdq.pt2", "text_decoder.pte"} <= set(manifest["files"])
    assert (out / ".text_decoder.qdq.key").is_file()
    umask = os.umask(0)
    os.umask(umask)
    assert {stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {0o666 & ~umask}  # the QDQ model too
