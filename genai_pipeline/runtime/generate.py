"""The generation loop: prefill the prompt, then sample and feed one token at a time, or, with
lookahead, several at once (see lookahead.py).

It drives any Session (runtime/session.py): a program's, or an eager model's (for parity checks);
plain decoding needs only its `prefill` and `step`, lookahead also its `verify`, `can_verify`,
`verify_rows` and `rewind`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from genai_pipeline.errors import InputError
from genai_pipeline.options import SamplingOptions
from genai_pipeline.runtime.lookahead import DraftSizer, LookaheadOptions, NgramDrafter
from genai_pipeline.runtime.session import Session

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
    stop_reason: str = "length"  # "eos", "length", or "stopped" (on_token asked to stop)
    decode_calls: int = 0  # program calls after the first generated token (step or verify)
    verify_calls: int = 0  # of which verify calls (lookahead)
    drafted: int = 0  # tokens drafted into verify calls
    accepted: int = 0  # of which kept
    verify_seconds: float = 0.0  # of decode_seconds, the time in verify calls

    @property
    def verify_cost_in_steps(self) -> float:
        """A verify call's mean time over a plain call's (a decode step, with its sampling): what a
        verify call must give in tokens to pay off. 0.0 until both kinds of call ran."""
        steps = self.decode_calls - self.verify_calls
        if not self.verify_calls or not steps or self.decode_seconds <= self.verify_seconds:
            return 0.0
        return (self.verify_seconds / self.verify_calls) / ((self.decode_seconds - self.verify_seconds) / steps)

    @property
    def tokens_per_call(self) -> float:
        """Tokens each decode call gave: 1 without lookahead."""
        return (len(self.tokens) - 1) / self.decode_calls if self.decode_calls else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt_tokens) / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        steps = len(self.tokens) - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds else 0.0


def generate(
    model: Session,
    prompt_tokens: list[int],
    max_new_tokens: int,
    sampler: Callable[[torch.Tensor], int],
    eos_ids: tuple[int, ...] = (),
    on_token: Callable[[int], bool | None] | None = None,
    lookahead: LookaheadOptions = LookaheadOptions(),
    history: list[int] = (),
) -> Generation:
    """`on_token` gets each token as it comes; when it returns True, generation stops there.
    `history`: the tokens the cache already holds before the prompt (a chat's earlier turns);
    lookahead drafts from them too."""
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    result = Generation(prompt_tokens=list(prompt_tokens))
    ahead = _Lookahead(lookahead, [*history, *prompt_tokens]) if lookahead.draft_len else None
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
        if on_token is not None and on_token(token):  # the caller has what it wants (a stop string), or left
            result.stop_reason = "stopped"
            break
        if len(result.tokens) == max_new_tokens:
            break
        if len(result.tokens) == 1:
            start = time.perf_counter()  # decode speed excludes the first token (it came from prefill)
        if ahead is None:
            logits = model.step(token)
            result.decode_calls += 1
        else:
            logits = ahead.next_logits(model, token, max_new_tokens - len(result.tokens), result)
    if ahead is not None:
        ahead.drop(model)  # the cache holds what plain decoding would have fed, no more
    result.decode_seconds = time.perf_counter() - start if len(result.tokens) > 1 else 0.0
    return result


class _Lookahead:
    """One generation's drafter, and the logits a verify call computed for the drafted tokens
    beyond the next one: used while the samples agree with the draft, then dropped."""

    def __init__(self, options: LookaheadOptions, context: list[int]):
        self.drafter = NgramDrafter(options, context)
        self.sizer = DraftSizer(options.draft_len)
        self.rows: list[tuple[int, torch.Tensor]] = []  # (draft token, logits after it), in order
        self.kept: int | None = None  # drafted tokens kept since the last verify call (None: none yet)

    def drop(self, model: Session) -> None:
        """Forget the cache rows of drafted tokens that were not kept: the cursor moves back before them."""
        model.rewind(model.pos - len(self.rows))
        self.rows.clear()

    def next_logits(self, model: Session, token: int, remaining: int, result: Generation) -> torch.Tensor:
        """The logits after the sampled `token`; `remaining`: tokens still to generate after it."""
        self.drafter.extend([token])
        self.sizer.came(self.drafter.tokens)
        if self.rows and self.rows[0][0] == token:  # drafted right: already in the cache, logits known
            self.kept += 1
            result.accepted += 1
            return self.rows.pop(0)[1]
        self.drop(model)
        if self.kept is not None:
            self.drafter.accepted(self.kept)
            self.kept = None
        # k drafted tokens give up to k + 1 tokens: never feed more than plain decoding would.
        draft = self.drafter.draft(remaining - 1)
        while draft and not model.can_verify(1 + len(draft)):  # the context's end, or a verify length
            draft = draft[:-1]
        if draft:
            self.sizer.drafted(draft, len(self.drafter.tokens))
            draft = draft[: self.sizer.size(len(draft), model.verify_rows)]
        result.decode_calls += 1
        start = time.perf_counter()
        if not draft:
            logits = model.step(token)
            self.sizer.timed(1, time.perf_counter() - start)
            return logits
        rows = model.verify([token, *draft])
        seconds = time.perf_counter() - start
        self.sizer.timed(model.verify_rows(1 + len(draft)), seconds)
        result.verify_seconds += seconds
        self.rows = list(zip(draft, rows[1:]))
        self.kept = 0
        result.verify_calls += 1
        result.drafted += len(draft)
        return rows[0]
