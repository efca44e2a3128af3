"""Export folders written before the methods took the names ExecuTorch's runners call
(docs/decisions/0035): the static chunk was `prefill`, the chunk of any length `prefill_long`, the
one-token method `decode`. Made here from today's exports, their methods renamed back in the
flatbuffer and in the manifest; `genai run` still runs them, logit for logit."""

import pytest
import torch
from conftest import TINY_VOCAB, rename_methods

from genai_pipeline.inspect import inspect_program
from genai_pipeline.runtime.open import open_session

OLD = {"prefill": "prefill_long", "prefill_chunk": "prefill", "decode_token": "decode"}
PROMPT = torch.randint(1, TINY_VOCAB, (21,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.mark.parametrize("form", ["hybrid", "hybrid, no prefill", "kv", "cache-io"])
def test_an_export_from_before_the_rename_still_runs(export_tiny, tmp_path, form):
    folder = {
        "hybrid": lambda: export_tiny("hybrid"),
        "hybrid, no prefill": lambda: export_tiny("hybrid", long_prefill_len=0),
        "kv": lambda: export_tiny("kv"),
        "cache-io": lambda: export_tiny("hybrid", "portable", cache_io=True),
    }[form]()
    old = rename_methods(folder, tmp_path / "old", OLD)
    runners = inspect_program(old / "text_decoder.pte")["stock_runners"]
    assert runners["TextLLMRunner"] is not None  # re-export for ExecuTorch's runner
    today, before = open_session(folder), open_session(old)
    assert torch.equal(today.prefill(PROMPT), before.prefill(PROMPT))
    assert torch.equal(today.step(7), before.step(7))
    if form == "hybrid":
        assert before.long_prefill_len == today.long_prefill_len > 0  # its `prefill_long` is used
