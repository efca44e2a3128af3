"""Compatibility: the `dynamic` program runs in ExecuTorch's own LLM runner, token for token,
float and quantized (the default 8da4w: rotated, with its float head rotation before the head)."""

import json
import subprocess
import sys

import pytest
from conftest import Q4

from genai_pipeline.options import QuantOptions


@pytest.mark.parametrize("quant", [QuantOptions(), Q4], ids=["fp32", "8da4w"])
def test_dynamic_program_runs_in_executorch_text_llm_runner(export_reference, quant):
    folder = export_reference("dynamic", quant)
    prompt, n = "The list object", 40
    ours = subprocess.run(
        [
            sys.executable,
            "-m",
            "genai_pipeline.cli",
            "run",
            str(folder),
            "--prompt",
            prompt,
            "--max-new-tokens",
            str(n),
            "--temperature",
            "0",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    ours = json.loads(ours.stdout)

    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  kernels the program calls
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    runner = TextLLMRunner(str(folder / "text_decoder.pte"), str(folder / "tokenizer.json"))
    pieces, stats = [], []
    runner.generate(
        # num_bos=1: ExecuTorch's C++ tokenizer takes its BOS token from tokenizer.json's post-processor,
        # but the runner adds it only when asked.
        prompt,
        GenerationConfig(echo=False, max_new_tokens=n, temperature=0.0, num_bos=1),
        token_callback=pieces.append,
        stats_callback=stats.append,
    )
    assert stats and stats[0].num_prompt_tokens == len(ours["prompt_tokens"])  # same prompt ids, BOS included
    assert len(pieces) == len(ours["tokens"]) == n  # one callback per generated token
    assert "".join(pieces) == ours["text"]
