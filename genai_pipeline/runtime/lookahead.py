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

from dataclasses import dataclass

from genai_pipeline.errors import InputError


@dataclass(frozen=True)
class LookaheadOptions:
    draft_len: int = 0  # tokens drafted per verify call, at most; 0: plain decoding
    max_ngram: int = 3  # the longest suffix of the context looked up; shorter ones after a miss
    min_ngram: int = 2  # a single repeated token predicts little in free text (bench/README.md)
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
    of the context's longest matching suffix. Updated as tokens come, O(max_ngram) per token."""

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


def lookahead_options(draft_len: int, session) -> LookaheadOptions:
    """`--lookahead N` for a loaded session: refused when its program has no `verify` method,
    capped at what one verify call takes (the last token + N drafts)."""
    options = LookaheadOptions(draft_len=draft_len)
    verify_len = getattr(session, "verify_len", 0)  # a vision-language program has no `verify`
    if draft_len and not verify_len:
        raise InputError("--lookahead needs a program with a `verify` method: re-export with --verify-len N (e.g. 8)")
    if draft_len >= verify_len > 0:
        options = LookaheadOptions(draft_len=verify_len - 1)
    return options
