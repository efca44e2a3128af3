"""Export folders written before the methods took the names ExecuTorch's runners call
(docs/decisions/0034): the static chunk was `prefill`, the chunk of any length `prefill_long`, the
one-token method `decode`. Made here from today's exports, their methods renamed back in the
flatbuffer and in the manifest; `genai run` still runs them, logit for logit."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, manifest
from executorch.exir._serialize._program import deserialize_pte_binary, serialize_pte_binary

from genai_pipeline.inspect import inspect_program
from genai_pipeline.runtime.open import open_session

OLD = {"prefill": "prefill_long", "prefill_chunk": "prefill", "decode_token": "decode"}
PROMPT = torch.randint(1, TINY_VOCAB, (21,), generator=torch.Generator().manual_seed(5)).tolist()


def as_before_the_rename(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    pte = dest / "text_decoder.pte"
    program = deserialize_pte_binary(pte.read_bytes())
    for plan in program.program.execution_plan:
        plan.name = OLD.get(plan.name, plan.name)
    data = bytes(
        serialize_pte_binary(
            program, extract_delegate_segments=True, segment_alignment=128, constant_tensor_alignment=16
        )
    )
    pte.write_bytes(data)
    m = manifest(dest)
    entry = m["artifacts"]["text_decoder"]
    entry["methods"] = [OLD.get(name, name) for name in entry["methods"]]
    entry["dynamic_methods"] = [OLD.get(name, name) for name in entry["dynamic_methods"]]
    if "cache_io" in m:
        m["cache_io"]["tokens_per_call"] = {OLD.get(k, k): n for k, n in m["cache_io"]["tokens_per_call"].items()}
    m["files"]["text_decoder.pte"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (dest / "manifest.json").write_text(json.dumps(m))
    return dest


@pytest.mark.parametrize("form", ["hybrid", "hybrid, no prefill", "kv", "cache-io"])
def test_an_export_from_before_the_rename_still_runs(export_tiny, tmp_path, form):
    folder = {
        "hybrid": lambda: export_tiny("hybrid"),
        "hybrid, no prefill": lambda: export_tiny("hybrid", long_prefill_len=0),
        "kv": lambda: export_tiny("kv"),
        "cache-io": lambda: export_tiny("hybrid", "portable", cache_io=True),
    }[form]()
    old = as_before_the_rename(folder, tmp_path / "old")
    assert "decode" in inspect_program(old / "text_decoder.pte")["methods"]
    today, before = open_session(folder), open_session(old)
    assert torch.equal(today.prefill(PROMPT), before.prefill(PROMPT))
    assert torch.equal(today.step(7), before.step(7))
    if form == "hybrid":
        assert before.long_prefill_len == today.long_prefill_len > 0  # its `prefill_long` is used
