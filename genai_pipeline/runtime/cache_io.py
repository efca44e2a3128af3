"""The session of a program in the cache-I/O form (QNN's; models/cache_io.py has the contract): the
KV cache lives in Python, in the driver's buffers, as a device runner keeps it."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from genai_pipeline.errors import InputError
from genai_pipeline.manifest import Manifest
from genai_pipeline.models.cache_io import CacheIOContract, CacheIODriver, Runner
from genai_pipeline.names import GraphName
from genai_pipeline.runtime.session import CacheCursor
from genai_pipeline.upstream.executorch_logs import native_logs_hidden


class CacheIOSession(CacheCursor):
    """A Session over a cache-I/O program's methods, or its eager graphs (`eager_runner`): no
    `verify` method in this form, so lookahead decoding stays off."""

    def __init__(self, contract: CacheIOContract, run: Runner, manifest: Manifest | None = None):
        self.contract, self.manifest = contract, manifest
        self.driver = CacheIODriver(contract, run)
        self.max_seq_len = contract.max_seq_len
        self.pos = 0

    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` at the cursor, in chunks of the prefill length (the last one left-padded),
        or token by token without a prefill method; returns the next-token logits, [vocab]."""
        if not tokens:
            raise InputError("the prompt is empty")
        self._check_room(len(tokens))
        logits = self.driver.feed(tokens, self.pos)
        self.pos += len(tokens)
        return logits

    def step(self, token: int) -> torch.Tensor:
        self._check_room(1)
        logits = self.driver.call(GraphName.DECODE_TOKEN, [token], self.pos)
        self.pos += 1
        return logits

    def score(self, tokens: list[int]) -> torch.Tensor:
        """The logits after every one of `tokens`, [T, vocab], one decode_token call each."""
        self._check_room(len(tokens))
        return torch.stack([self.step(token) for token in tokens])


def program_runner(methods: Mapping[GraphName, object]) -> Runner:
    """A loaded program's methods (executorch.runtime Method objects) as a Runner."""

    def run(method: GraphName, inputs: list) -> list:
        with native_logs_hidden():
            return list(methods[method].execute(inputs))

    return run
