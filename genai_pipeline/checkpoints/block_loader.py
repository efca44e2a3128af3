"""A decoder whose weights stay in the checkpoint until a block is needed.

A checkpoint reader (hf.open_decoder) hands back the decoder built on the meta device and a
BlockLoader: the quantizer loads one block in float, quantizes it and moves on
(quantize/streaming.py), and the float model an export is verified against loads each block for
its forward and lets it go (`offload`), so neither ever holds the float model whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

OUTER = ("tok_embeddings.weight", "norm.weight", "output.weight")  # the tensors outside the blocks


@dataclass(frozen=True)
class BlockLoader:
    """`read(names)`: our tensors (`layers.3.attention.wq.weight`, ...) in float32, from the checkpoint."""

    read: Callable[[Iterable[str]], dict[str, torch.Tensor]]

    def load_outer(self, decoder: nn.Module, names: Iterable[str] = OUTER) -> None:
        """The embedding, final norm and LM head (those of `names` the checkpoint holds: a tied head
        is the embedding)."""
        want = [
            n for n in names if _is_meta(decoder, n) and not (n == "output.weight" and decoder.config.tie_embeddings)
        ]
        _assign(decoder, self.read(want))
        if "tok_embeddings.weight" in want:
            decoder.tie_weights()

    def load_block(self, decoder: nn.Module, i: int) -> nn.Module:
        """Block i with its float weights (a no-op when they are there); returns the block."""
        block = decoder.layers[i]
        names = [f"layers.{i}.{n}" for n, p in block.named_parameters() if p.is_meta]
        if names:
            _assign(decoder, self.read(names))
        return block

    def load_all(self, decoder: nn.Module) -> None:
        self.load_outer(decoder)
        for i in range(len(decoder.layers)):
            self.load_block(decoder, i)


def release_outer(decoder: nn.Module, names: Iterable[str]) -> None:
    """The named outer tensors back to the meta device, for load_outer to read again (a tied head
    goes with the table)."""
    for name in names:
        tied = name == "tok_embeddings.weight" and decoder.config.tie_embeddings
        for n in (name, "output.weight") if tied else (name,):
            owner, _, leaf = n.rpartition(".")
            _to_meta(decoder.get_submodule(owner), leaf)


def release_block(block: nn.Module) -> None:
    """Back to the meta device: the block's weights are freed (its KV cache stays)."""
    for module in block.modules():
        for name, _ in list(module.named_parameters(recurse=False)):
            _to_meta(module, name)


def _to_meta(module: nn.Module, name: str) -> None:
    p = getattr(module, name)
    setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False))


def offload(decoder: nn.Module, loader: BlockLoader) -> nn.Module:
    """`decoder` (its outer tensors loaded) running as the whole model does, each block loaded from
    the checkpoint for its forward and released after: one block in float at a time."""
    loader.load_outer(decoder)
    for i, block in enumerate(decoder.layers):
        block.register_forward_pre_hook(lambda _, __, i=i: loader.load_block(decoder, i) and None)
        block.register_forward_hook(lambda b, _, __: release_block(b))
    decoder.offloaded = True
    return decoder


def _is_meta(decoder: nn.Module, name: str) -> bool:
    return decoder.get_parameter(name).is_meta


def _assign(decoder: nn.Module, state: dict[str, torch.Tensor]) -> None:
    for name, tensor in state.items():
        owner, _, leaf = name.rpartition(".")
        setattr(decoder.get_submodule(owner), leaf, nn.Parameter(tensor, requires_grad=False))
