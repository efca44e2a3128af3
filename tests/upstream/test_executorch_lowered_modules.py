"""The ExecuTorch behaviour genai_pipeline/upstream/executorch_lowered_modules.py relies on: the
emitter reads only the graph of a lowered module's original program, so its weights can go before
the program is emitted. These fail when an upgrade changes it."""

import gc
import weakref

import torch
from pretend_installed import pretend_installed
from torch import nn

from genai_pipeline.upstream.executorch_lowered_modules import release_delegated_weights


class TiedTableAndMlp(nn.Module):
    """A lookup outside the delegate and a head reading the same table (kept: the graph reads it),
    and an MLP whose weights only the delegate reads (let go)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(256, 64)
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)
        self.head = nn.Linear(64, 256, bias=False)
        self.head.weight = nn.Parameter(self.embedding.weight.detach(), requires_grad=False)

    def forward(self, tokens):
        return self.head(self.down(torch.relu(self.up(self.embedding(tokens)))))


def _edge(module, tokens):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    program = torch.export.export(module, (tokens,), strict=False)
    return to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])


def test_a_program_emitted_after_the_release_is_byte_identical_and_the_weights_are_freed(monkeypatch):
    tokens = torch.tensor([[1, 7, 200, 255]])
    want = _edge(TiedTableAndMlp().eval(), tokens).to_executorch().buffer

    module = TiedTableAndMlp().eval()
    edge = _edge(module, tokens)
    up = weakref.ref(module.up.weight)
    del module
    gc.collect()
    assert up() is not None  # the delegate's original program holds it
    assert release_delegated_weights(edge) >= 4  # up, down: weights and biases
    gc.collect()
    assert up() is None
    assert edge.to_executorch().buffer == want

    pretend_installed(monkeypatch, executorch="1.6.0")
    assert release_delegated_weights(_edge(TiedTableAndMlp().eval(), tokens)) == 0
