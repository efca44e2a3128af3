"""genai bench on the tiny program: its figures agree with each other and with the program."""

import json

import numpy as np
import pytest
import torch
from conftest import Q4, TINY_MAX_SEQ

from genai_pipeline.bench.host import memory_bandwidth_gbs
from genai_pipeline.bench.text import bench, weight_bytes_per_token
from genai_pipeline.bundle import read_manifest
from genai_pipeline.cli import main
from genai_pipeline.inspect import constant_sizes, inspect_program
from genai_pipeline.options import BenchOptions
from genai_pipeline.upstream.executorch_pte_reader import read_program


def test_bench_reports_rates_memory_and_bandwidth_share(export_tiny, capsys):
    folder = export_tiny("dynamic")
    assert main(["bench", str(folder), "--prompt-len", "8", "--gen-len", "8", "--repeats", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert {"prefill_tokens_per_s", "decode_tokens_per_s", "load_s", "peak_rss_mb", "bandwidth_share"} <= r.keys()
    assert r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 and r["load_s"] > 0 and r["peak_rss_mb"] > 0
    # Every stored weight but the fp32 token embedding, of which a step reads one row.
    stored = inspect_program(folder / "text_decoder.pte")
    embedding = embedding_lookup_bytes(folder / "text_decoder.pte")
    assert (
        r["weight_bytes_per_token"]
        == stored["named_data"]["bytes"] + stored["constant_segment"]["bytes"] - embedding
        > 0
    )
    rate = r["weight_bytes_per_token"] * r["decode_tokens_per_s"] / 1e9
    assert r["bandwidth_share"] == pytest.approx(rate / r["memory_bandwidth_gbs"], rel=0.05, abs=1e-4)


def embedding_lookup_bytes(pte) -> int:
    """Oracle: the bytes of the constant tensors the program's embedding lookup reads (its table
    and, when quantized, its scales), found among the operator calls of the program itself."""
    program, _ = read_program(pte)
    sizes = constant_sizes(program)
    found = set()
    for plan in program.execution_plan:
        for chain in plan.chains:
            for call in (i.instr_args for i in chain.instructions):
                if type(call).__name__ == "KernelCall" and "embedding" in plan.operators[call.op_index].name:
                    tensors = (plan.values[a].val for a in call.args)
                    found |= {
                        t.data_buffer_idx for t in tensors if type(t).__name__ == "Tensor" and t.data_buffer_idx > 0
                    }
    assert found, "no embedding lookup among the program's operators"
    return sum(sizes[b] for b in found)


def test_weight_bytes_per_token_leave_out_a_quantized_embedding_table(export_reference):
    folder = export_reference("kv", Q4)  # int8 token embedding with a scale per row
    manifest = read_manifest(folder)
    stored = inspect_program(folder / "text_decoder.pte")
    table = embedding_lookup_bytes(folder / "text_decoder.pte")
    assert table > manifest["config"]["vocab_size"] * manifest["config"]["dim"]  # the scales are in it
    assert (
        weight_bytes_per_token(folder, manifest)
        == stored["named_data"]["bytes"] + stored["constant_segment"]["bytes"] - table
    )


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


def test_lookahead_rates_are_measured_on_plain_decodings_tokens():
    from genai_pipeline.bench.text import replay_sampler
    from genai_pipeline.runtime.generate import Generation

    plain = Generation(prompt_tokens=[1], tokens=[5, 6, 7], stop_reason="eos")
    sampler = replay_sampler(plain, (2, 3))
    assert [sampler(torch.zeros(9)) for _ in range(4)] == [5, 6, 7, 2]  # then the end of turn that stopped it
