"""genai bench on the tiny program: its figures agree with each other and with the program."""

import json

import numpy as np
import pytest

from conftest import TINY_MAX_SEQ
from genai_pipeline.bench import BenchOptions, bench, memory_bandwidth_gbs
from genai_pipeline.cli import main
from genai_pipeline.inspect import inspect_program


def test_bench_reports_rates_memory_and_bandwidth_share(export_tiny, capsys):
    folder = export_tiny("dynamic")
    assert main(["bench", str(folder), "--prompt-len", "8", "--gen-len", "8", "--repeats", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert {"prefill_tokens_per_s", "decode_tokens_per_s", "load_s", "peak_rss_mb", "bandwidth_share"} <= r.keys()
    assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 and r["load_s"] > 0 and r["peak_rss_mb"] > 0
    # Every stored weight but the fp32 token embedding, of which a step reads one row.
    stored = inspect_program(folder / "text_decoder.pte")
    config = json.loads((folder / "manifest.json").read_text())["config"]
    embedding = 4 * config["vocab_size"] * config["dim"]
    assert r["weight_bytes_per_token"] == stored["named_data"]["bytes"] + stored["constant_segment"]["bytes"] - embedding > 0
    rate = r["weight_bytes_per_token"] * r["decode_tokens_per_s"] / 1e9
    assert r["bandwidth_share"] == pytest.approx(rate / r["memory_bandwidth_gbs"], rel=0.05, abs=1e-4)


def test_bench_refuses_more_tokens_than_the_context(export_tiny):
    from genai_pipeline.errors import InputError

    with pytest.raises(InputError, match="exceeds the program's context"):
        bench(export_tiny("dynamic"), BenchOptions(prompt_len=TINY_MAX_SEQ, gen_len=1, repeats=1))


def test_bandwidth_probe_copies_every_slice(monkeypatch):
    """The probe splits one copy across the cores: every byte is copied, by as many threads."""
    copied = []
    real = np.copyto
    monkeypatch.setattr(np, "copyto", lambda dst, src: copied.append(len(src)) or real(dst, src))
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert memory_bandwidth_gbs(megabytes=3, repeats=2) > 0
    assert len(copied) == 6 and sum(copied) == 2 * 3 * 2**20 // 8
