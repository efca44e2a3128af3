"""Compatibility: the default (`hybrid`) and the `dynamic` program run in ExecuTorch's own LLM
runner, token for token as `genai run`, float and quantized (the default 8da4w: rotated, with its
float head rotation before the head), for a prompt of one prefill call and one of several."""

import json
import subprocess
import sys

import pytest
from conftest import Q4, REFERENCE, rename_methods, text_llm_runner

from genai_pipeline.inspect import inspect_program
from genai_pipeline.manifest import Manifest
from genai_pipeline.options import QuantOptions

SHORT = "The list object"  # 4 tokens with BOS
LONG = (REFERENCE / "heldout.txt").read_text()[:600]  # 175 tokens: more than a hybrid program's `prefill` takes (128)
NEW_TOKENS = 40


def genai_run(folder, prompt: str, n: int) -> dict:
    argv = ["run", str(folder), "--prompt", prompt, "--max-new-tokens", str(n), "--temperature", "0", "--json"]
    result = subprocess.run([sys.executable, "-m", "genai_pipeline.cli", *argv], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize("quant", [QuantOptions(), Q4], ids=["fp32", "8da4w"])
@pytest.mark.parametrize("mode", ["hybrid", "dynamic"])
def test_program_runs_in_executorch_text_llm_runner(export_reference, mode, quant):
    folder = export_reference(mode, quant)
    assert inspect_program(folder / "text_decoder.pte")["stock_runners"]["TextLLMRunner"] is None
    chunk = Manifest.read(folder).artifacts["text_decoder"].constant_methods["get_max_seq_len"]
    for prompt in (SHORT, LONG):
        ours = genai_run(folder, prompt, NEW_TOKENS)
        text, generated, prompt_tokens = text_llm_runner(folder, prompt, NEW_TOKENS, bos=True)
        assert prompt_tokens == len(ours["prompt_tokens"])  # the same prompt ids, BOS included
        assert generated == len(ours["tokens"]) == NEW_TOKENS  # one callback per generated token
        assert text == ours["text"]
    if mode == "hybrid":  # the runner sent the long prompt through `prefill` in chunks
        assert 4 < chunk < prompt_tokens


def test_a_program_genai_inspect_says_it_does_not_run_in_fails_there(export_reference):
    folder = export_reference("kv")  # decode_token alone: nothing TextLLMRunner prefills with
    why = inspect_program(folder / "text_decoder.pte")["stock_runners"]["TextLLMRunner"]
    assert why == "no `forward` or `prefill` method"
    with pytest.raises(RuntimeError):
        text_llm_runner(folder, SHORT, 4, bos=True)


def test_a_decode_method_beside_prefill_reads_a_cache_of_its_own_in_the_runner(export_reference, tmp_path):
    """Why the one-token method is not named `decode` (docs/decisions/0035): the pinned runner would
    decode through it with arenas of its own, never seeing the KV cache `prefill` wrote. When this
    fails, the runner shares them, and `decode` can be the name."""
    folder = export_reference("hybrid", QuantOptions())
    renamed = rename_methods(folder, tmp_path / "renamed", {"decode_token": "decode"})
    why = inspect_program(renamed / "text_decoder.pte")["stock_runners"]["TextLLMRunner"]
    assert why == "`prefill` and `decode` share a KV cache, which the runner gives each method one of"
    right, _, _ = text_llm_runner(folder, LONG, NEW_TOKENS, bos=True)
    wrong, _, _ = text_llm_runner(renamed, LONG, NEW_TOKENS, bos=True)
    assert right[:1] == wrong[:1] and right != wrong  # the first token comes from `prefill`
