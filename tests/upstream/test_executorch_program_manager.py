"""The ExecuTorch behaviour genai_pipeline/upstream/executorch_program_manager.py relies on, checked on a
tied embedding in ExecuTorch's own lowering: these fail when an upgrade changes it."""

import inspect

import torch
from pretend_installed import pretend_installed
from torch import nn

from genai_pipeline.inspect import inspect_program
from genai_pipeline.upstream.executorch_program_manager import store_shared_bytes_once

VOCAB, DIM = 512, 64


class TiedLookupAndHead(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = nn.Parameter(self.embedding.weight.detach(), requires_grad=False)  # as Decoder.tie_weights
        self.norm = nn.LayerNorm(DIM)

    def forward(self, tokens):
        return self.head(self.norm(self.embedding(tokens)))


def _lowered():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    module = TiedLookupAndHead().eval()
    tokens = torch.tensor([[1, 7, 300, 511]])
    program = torch.export.export(module, (tokens,), strict=False)
    config = ExecutorchBackendConfig()
    return (
        to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch(config),
        config,
        module,
        tokens,
    )


def test_the_private_names_it_uses_are_the_pinned_wheels():
    from executorch.exir._serialize import _program, _serialize

    manager, _, _, _ = _lowered()
    for name in ("_named_data", "_emitter_output", "_data_serializer", "_pte_data", "_tensor_data", "_buffer"):
        assert hasattr(manager, name), name
    assert list(inspect.signature(_serialize.serialize_for_executorch).parameters)[:4] == [
        "emitter_output",
        "config",
        "data_serializer",
        "named_data_store",
    ]
    assert callable(_program._program_to_flatbuffer)
    # serialize_pte_binary calls the module-level name the patch swaps in while it serializes.
    assert "_program_to_flatbuffer" in _program.serialize_pte_binary.__code__.co_names


def test_another_executorch_leaves_the_program_as_serialized(monkeypatch):
    manager, config, _, _ = _lowered()
    data = manager.buffer
    pretend_installed(monkeypatch, executorch="1.6.0")
    assert store_shared_bytes_once(manager, config) == 0
    assert manager.buffer == data


def test_the_delegated_head_reads_the_lookups_table_and_the_program_runs(tmp_path):
    from executorch.runtime import Runtime

    manager, config, module, tokens = _lowered()
    table = VOCAB * DIM * 4
    before = tmp_path / "before.pte"
    before.write_bytes(manager.buffer)
    report = inspect_program(before)
    # Upstream stores the table twice: a constant of the lookup, named data of XNNPACK's head.
    assert report["weights"]["stored_twice_bytes"] == table
    assert store_shared_bytes_once(manager, config) == table
    after = tmp_path / "after.pte"
    with open(after, "wb") as f:
        manager.write_to_file(f)
    report = inspect_program(after)
    assert before.stat().st_size - after.stat().st_size >= table
    assert report["weights"]["stored_twice_bytes"] == 0
    assert report["weights"]["named_data_in_constant_segment_bytes"] == table
    # The runtime loads named data as its segment's range, overlapping segments and all.
    got = Runtime.get().load_program(after).load_method("forward").execute([tokens])[0]
    torch.testing.assert_close(got, module(tokens), rtol=1e-5, atol=1e-5)


def test_nothing_changes_without_shared_bytes():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    module = nn.Sequential(nn.Linear(8, 8)).eval()
    program = torch.export.export(module, (torch.ones(1, 8),), strict=False)
    config = ExecutorchBackendConfig()
    manager = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch(config)
    data = bytes(manager._pte_data)
    assert store_shared_bytes_once(manager, config) == 0
    assert manager.buffer == data
