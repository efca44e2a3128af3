"""Lossless lookahead decoding: draft tokens from the context, check them in one program call.

Prompt lookup: when the last few tokens occurred earlier in the context (the prompt and what was
generated), the tokens that followed them then are the draft. The program's `verify` method feeds
the last token and the draft in one call and returns the logits after each of them; the loop in
`generate` samples from those rows in order, exactly as plain decoding would from its own steps,
and keeps a row only while the token it sampled is the draft's next one. So every emitted token
is drawn from the same distribution, with the same sampler calls in the same order, as in plain
decoding: greedy output is identical, and a seeded sampler gives identical tokens too (up to
the float differences of a batched call, which never mattered in the tests).

For a point-mass draft this IS speculative sampling's acceptance rule: accept draft d with
probability min(1, p(d) / q(d)) = p(d), else draw from the residual max(0, p - q), normalised,
which is p without d. Drawing t ~ p and accepting iff t == d accepts with probability p(d), and
on a miss gives t with probability p(t) / (1 - p(d)) for every t != d: the same rule.

The cache keeps only accepted rows: the caller's cursor moves back past the rejected ones, and
causal attention never reads positions past the cursor (they are overwritten).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from genai_pipeline.errors import InputError


@dataclass(frozen=True)
class LookaheadOptions:
    draft_len: int = 0  # tokens drafted per verify call, at most; 0: plain decoding
    # The longest suffix of the context looked up; shorter ones after a miss. Long: a short suffix
    # recurs where copied or looping text goes on differently, and its latest occurrence is then
    # often the wrong one; the longest match is the likeliest (docs/decisions/0031).
    max_ngram: int = 16
    min_ngram: int = 2  # a single repeated token predicts little in free text (docs/decisions/0010)
    # After a verify call that accepted no draft, drafting pauses for 1, 2, 4, ... steps (up to
    # this many): a miss costs more than a decode step, and free text rarely repeats itself.
    max_backoff: int = 16

    def __post_init__(self):
        if self.draft_len < 0:
            raise InputError(f"--lookahead must be >= 0, got {self.draft_len}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise InputError(f"n-gram sizes must satisfy 1 <= min ({self.min_ngram}) <= max ({self.max_ngram})")


class NgramDrafter:
    """The context, and for every n-gram in it (n in [min_ngram, max_ngram]) where its latest
    occurrence that has a successor ends: a draft is what followed the latest earlier occurrence
    of the context's longest matching suffix (up to max_ngram tokens). Updated as tokens come,
    O(max_ngram) per token (~16 us at 16)."""

    def __init__(self, options: LookaheadOptions, context: list[int]):
        self.options = options
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it
        self.backoff, self.skip = 0, 0
        self.extend(context)

    def extend(self, tokens: list[int]) -> None:
        o = self.options
        for token in tokens:
            j = len(self.tokens)  # `token`'s index: it follows the n-grams ending at j - 1
            for n in range(o.min_ngram, min(o.max_ngram, j) + 1):
                self.after[tuple(self.tokens[j - n : j])] = j
            self.tokens.append(token)

    def draft(self, limit: int) -> list[int]:
        """Up to `limit` tokens that may come next (none while backing off after misses)."""
        if limit < 1 or self.skip:
            self.skip = max(0, self.skip - 1)
            return []
        o, tokens = self.options, self.tokens
        for n in range(min(o.max_ngram, len(tokens)), o.min_ngram - 1, -1):
            start = self.after.get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return tokens[start : start + min(limit, o.draft_len)]
        return []

    def accepted(self, n: int) -> None:
        """How many drafted tokens the last verify call kept: a miss pauses drafting."""
        if n:
            self.backoff = 0
        else:
            self.backoff = min(2 * self.backoff or 1, self.options.max_backoff)
            self.skip = self.backoff


class DraftSizer:
    """How many of a draft's tokens one verify call checks: the number that gives the most tokens
    per second, from what calls of each length have cost and how often each draft position was
    kept. Where rows cost little (a Xeon's AMX) that is the whole draft; where each row costs nearly
    a decode step (AVX2's 4-bit kernels) it is the short drafts, longer ones only while the text is
    being copied (docs/decisions/0030). A verify of one length only (padded, older exports) costs
    the same for any: the whole draft. Pausing after misses is the drafter's back-off, not this.

    Every draft is scored whole, checked or not: once the tokens it predicted have come (verified,
    or generated by later calls), each of its positions counts as kept or missed. Scoring only the
    checked positions left the unchecked ones at what they were when checking stopped, so a run of
    short calls never learnt that the text had turned to copying (docs/decisions/0031)."""

    RECENT = 5  # calls of each length whose median time is its cost
    DECAY = 0.8  # per scored draft: acceptance follows the text's recent run of copying or not
    PRIOR = 0.75  # a position never scored yet: SmolLM2's traces kept 0.7-0.95 of each after a match

    def __init__(self, max_drafts: int):
        self.seconds: dict[int, list[float]] = {}  # rows of a call -> its recent times
        self.tried = [0.0] * max_drafts  # per draft position i: drafts that reached it with 1..i-1 kept
        self.kept = [0.0] * max_drafts  # of those, the drafts that kept it too
        self.open: list[tuple[list[int], int]] = []  # drafts not scored yet: (tokens, their first one's index)

    def timed(self, rows: int, seconds: float) -> None:
        recent = self.seconds.setdefault(rows, [])
        recent.append(seconds)
        del recent[: -self.RECENT]

    def drafted(self, draft: list[int], at: int) -> None:
        """A draft for the context's tokens from index `at` on, however much of it is checked."""
        self.open.append((draft, at))

    def came(self, context: list[int]) -> None:
        """The context so far: scores the open drafts it decides (a miss, or all their tokens came)."""
        still = []
        for draft, at in self.open:
            kept = 0
            while kept < len(draft) and at + kept < len(context) and draft[kept] == context[at + kept]:
                kept += 1
            if kept < len(draft) and at + kept == len(context):
                still.append((draft, at))
            else:
                self.scored(len(draft), kept)
        self.open = still

    def scored(self, drafted: int, kept: int) -> None:
        """A draft of `drafted` tokens whose first `kept` were right."""
        self.tried = [t * self.DECAY for t in self.tried]
        self.kept = [k * self.DECAY for k in self.kept]
        for i in range(min(kept + 1, drafted)):
            self.tried[i] += 1
            self.kept[i] += i < kept

    def cost(self, rows: int) -> float | None:
        """Seconds a call of `rows` takes: measured, else the nearest shorter call's (optimistic, so
        each length gets tried when it would be best), else the shortest call's; None before any."""
        if not self.seconds:
            return None
        shorter = [r for r in self.seconds if r <= rows]
        return statistics.median(self.seconds[max(shorter) if shorter else min(self.seconds)])

    def size(self, drafted: int, rows_of) -> int:
        """How many of `drafted` tokens to check; `rows_of(n)`: the rows a verify call of n tokens
        computes (the last token and n - 1 drafts, and a static verify's padding)."""
        if not self.seconds:
            return drafted
        best, best_rate, reach, expected = drafted, 0.0, 1.0, 1.0
        for n in range(1, drafted + 1):
            reach *= (self.kept[n - 1] + self.PRIOR) / (self.tried[n - 1] + 1.0)
            expected += reach
            rate = expected / self.cost(rows_of(n + 1))
            if rate > best_rate:
                best, best_rate = n, rate
        return best


def lookahead_options(draft_len: int, session) -> LookaheadOptions:
    """`--lookahead N` for a loaded session: refused when its program has no `verify` method,
    capped at what one verify call takes (the last token + N drafts)."""
    options = LookaheadOptions(draft_len=draft_len)
    verify_len = session.verify_len  # 0: no `verify` (a vision-language or cache-I/O program)
    if draft_len and not verify_len:
        raise InputError("--lookahead needs a program with a `verify` method: re-export with --verify-len N (e.g. 8)")
    if draft_len >= verify_len > 0:
        options = LookaheadOptions(draft_len=verify_len - 1)
    return options
