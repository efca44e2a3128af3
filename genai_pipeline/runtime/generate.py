"""The generation loop: prefill the prompt, then sample and feed one token at a time.

It drives anything with `prefill(tokens) -> logits` and `step(token) -> logits`: a program
session, or the eager model (for parity checks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from genai_pipeline.errors import InputError


class Steppable(Protocol):
    def prefill(self, tokens: list[int]) -> torch.Tensor: ...
    def step(self, token: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise InputError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"--top-p must be in (0, 1], got {self.top_p}")


# Per-token sampling runs beside a decode step of a few ms (SmolLM2-135M: ~3.6), so it avoids
# torch's slow paths at a 49k vocabulary: argmax ~60 us (NumPy's: ~3 us), multinomial ~0.9 ms
# (a cumulative sum and a binary search: ~0.05 ms), sort ~2.6 ms (NumPy's value sort: ~0.1 ms).


def greedy_token(logits: torch.Tensor) -> int:
    """The index of the largest logit, the first one on a tie (as torch.argmax)."""
    return int(logits.detach().reshape(-1).float().numpy().argmax())  # float: NumPy has no bfloat16


class Sampler:
    def __init__(self, options: SamplingOptions):
        self.options = options
        self.generator = torch.Generator().manual_seed(options.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        o = self.options
        if o.temperature == 0:
            return greedy_token(logits)
        logits = logits.detach().reshape(-1).float() / o.temperature
        if o.top_k:
            kth = torch.topk(logits, min(o.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if o.top_p < 1:
            # The smallest set of the likeliest tokens whose mass reaches top_p: every token at
            # least as likely as the one where the descending cumulative mass first reaches it.
            descending = torch.from_numpy(-np.sort(-probs.numpy()))
            cut = min(int(torch.searchsorted(descending.cumsum(0, dtype=torch.float64), o.top_p)), len(probs) - 1)
            probs = probs.masked_fill(probs < descending[cut], 0.0)
        return self._draw(probs)

    def _draw(self, probs: torch.Tensor) -> int:
        """Token i with probability probs[i] / sum(probs): the first whose cumulative mass
        exceeds a uniform draw. A zero-probability token adds no mass, so it is never drawn."""
        cdf = probs.cumsum(0, dtype=torch.float64)
        u = torch.rand((), dtype=torch.float64, generator=self.generator) * cdf[-1]
        i = int(torch.searchsorted(cdf, u, right=True))
        return i if i < len(cdf) else int(probs.nonzero()[-1])  # u rounded up to the total mass


@dataclass
class Generation:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # time of the steps after the first generated token
    stop_reason: str = "length"

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt_tokens) / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.tokens) - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds else 0.0


def generate(
    model: Steppable,
    prompt_tokens: list[int],
    max_new_tokens: int,
    sampler: Callable[[torch.Tensor], int],
    eos_ids: tuple[int, ...] = (),
    on_token: Callable[[int], None] | None = None,
) -> Generation:
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    result = Generation(prompt_tokens=list(prompt_tokens))
    start = time.perf_counter()
    logits = model.prefill(result.prompt_tokens)
    result.prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    while True:
        token = sampler(logits)
        if token in eos_ids:
            result.stop_reason = "eos"
            break
        result.tokens.append(token)
        if on_token is not None:
            on_token(token)
        if len(result.tokens) == max_new_tokens:
            break
        if len(result.tokens) == 1:
            start = time.perf_counter()  # decode speed excludes the first token (it came from prefill)
        logits = model.step(token)
    result.decode_seconds = time.perf_counter() - start if len(result.tokens) > 1 else 0.0
    return result
