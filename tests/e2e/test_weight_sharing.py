"""One copy of the weights for prefill (short and long chunks) + decode, measured on the shipped reference model."""

import json
import subprocess
import sys


def inspect_json(pte):
    result = subprocess.run(
        [sys.executable, "-m", "genai_pipeline.cli", "inspect", str(pte), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout)


def test_hybrid_program_stores_the_weights_once(export_reference):
    hybrid = inspect_json(export_reference("hybrid") / "text_decoder.pte")
    kv = inspect_json(export_reference("kv") / "text_decoder.pte")
    assert set(hybrid["methods"]) == {"prefill", "prefill_chunk", "decode_token"} and set(kv["methods"]) == {
        "decode_token"
    }
    assert hybrid["file_bytes"] <= 1.02 * kv["file_bytes"], (hybrid["file_bytes"], kv["file_bytes"])
    # and not because the weights went missing: ~4.2 M fp32 parameters live in the file once
    assert hybrid["named_data"]["shared_bytes"] + hybrid["constant_segment"]["shared_bytes"] > 4.0e6 * 4
    assert all(b["shared"] for b in hybrid["mutable_buffers"].values())
