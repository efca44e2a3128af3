"""Lookahead decoding on scripted models: same tokens as plain decoding, fewer calls, a cache
cursor that keeps only what plain decoding would have fed. Programs: test_lookahead_program.py."""

import hashlib

import pytest
import torch

from genai_pipeline.errors import InputError
from genai_pipeline.options import SamplingOptions
from genai_pipeline.runtime.generate import Sampler, generate
from genai_pipeline.runtime.lookahead import DraftSizer, LookaheadOptions, NgramDrafter


class Contextual:
    """A model whose logits are a fixed pseudo-random function of the whole context (so a wrong
    cache is visible): it keeps the tokens it was fed at each position, as a KV cache does, and
    verify writes past the cursor like the program does. `period` > 0 makes greedy text repeat."""

    def __init__(self, vocab=50, period=0, verify_len=8, max_seq_len=200):
        self.vocab, self.period, self.verify_len, self.max_seq_len = vocab, period, verify_len, max_seq_len
        self.cache: list[int] = []
        self.pos = 0
        self.calls = {"prefill": 0, "step": 0, "verify": 0}

    def _logits(self, upto: int) -> torch.Tensor:
        context = self.cache[:upto]
        seed = int.from_bytes(hashlib.sha256(str(context).encode()).digest()[:8], "little")
        logits = torch.randn(self.vocab, generator=torch.Generator().manual_seed(seed))
        if self.period:  # a strong preference for what came `period` tokens ago
            logits[context[-self.period] if len(context) >= self.period else 0] += 6.0
        return logits

    def _feed(self, tokens):
        assert self.pos + len(tokens) <= self.max_seq_len
        self.cache[self.pos :] = []  # rows past the cursor are garbage: never read again
        self.cache += tokens
        rows = torch.stack([self._logits(self.pos + i + 1) for i in range(len(tokens))])
        self.pos += len(tokens)
        return rows

    def prefill(self, tokens):
        self.calls["prefill"] += 1
        return self._feed(tokens)[-1]

    def step(self, token):
        self.calls["step"] += 1
        return self._feed([token])[-1]

    def can_verify(self, n):
        return 1 <= n <= self.verify_len and self.pos + n <= self.max_seq_len

    def rewind(self, pos):
        assert pos <= self.pos
        self.pos = pos

    def verify_rows(self, n):
        return n

    def verify(self, tokens):
        self.calls["verify"] += 1
        return self._feed(tokens)


def run(model, prompt, n, sampling=SamplingOptions(), draft_len=0, eos=()):
    result = generate(model, prompt, n, Sampler(sampling), eos, lookahead=LookaheadOptions(draft_len=draft_len))
    # The cache holds the prompt and every generated token but the last, as in plain decoding.
    assert model.pos == len(prompt) + max(0, len(result.tokens) - (result.stop_reason != "eos"))
    assert model.cache[: model.pos] == (prompt + result.tokens)[: model.pos]
    return result


@pytest.mark.parametrize("sampling", [SamplingOptions(), SamplingOptions(temperature=0.8, top_p=0.9, seed=3)])
@pytest.mark.parametrize("period", [0, 5])
def test_lookahead_gives_the_tokens_of_plain_decoding(sampling, period):
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    plain = run(Contextual(period=period), prompt, 80, sampling)
    model = Contextual(period=period)
    ahead = run(model, prompt, 80, sampling, draft_len=6)
    assert ahead.tokens == plain.tokens
    assert ahead.decode_calls == model.calls["step"] + model.calls["verify"]
    if period:  # repeating text: drafts are kept, fewer calls than tokens
        assert ahead.accepted > 20 and ahead.tokens_per_call > 1.5
        assert 0 < ahead.verify_seconds < ahead.decode_seconds and ahead.verify_cost_in_steps > 0
    assert plain.verify_seconds == 0 and plain.verify_cost_in_steps == 0
    assert plain.tokens_per_call == 1.0


def test_eos_in_the_middle_of_an_accepted_draft_stops_there():
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    plain = run(Contextual(period=5), prompt, 60)
    eos = plain.tokens[30]
    expected = plain.tokens[: plain.tokens.index(eos)]
    result = run(Contextual(period=5), prompt, 60, draft_len=6, eos=(eos,))
    assert result.tokens == expected and result.stop_reason == "eos"


def test_lookahead_at_the_context_edge_feeds_no_more_than_plain_decoding():
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
    room = 40 - len(prompt) + 1  # as `genai run` caps it: the last token is never fed
    plain = run(Contextual(period=5, max_seq_len=40), prompt, room)
    result = run(Contextual(period=5, max_seq_len=40), prompt, room, draft_len=6)
    assert result.tokens == plain.tokens and len(result.tokens) == room


def test_drafts_are_what_followed_the_latest_earlier_occurrence():
    drafter = NgramDrafter(LookaheadOptions(draft_len=3, max_ngram=3, min_ngram=1), [7, 1, 2, 9, 1, 2, 8, 5, 6, 1, 2])
    assert drafter.draft(10) == [8, 5, 6]  # [1, 2] last came before 8
    drafter.extend([8])
    assert drafter.draft(10) == [5, 6, 1]  # [1, 2, 8] matched
    assert drafter.draft(1) == [5]
    unseen = NgramDrafter(LookaheadOptions(draft_len=3, min_ngram=2), [1, 2, 3, 4])
    assert unseen.draft(10) == []


def test_the_longest_earlier_match_drafts_not_the_latest_short_one():
    # [3, 4] last came before 7, but the whole suffix [1, 2, 3, 4] came before 9
    context = [1, 2, 3, 4, 9, 9, 5, 5, 5, 5, 3, 4, 7, 7, 1, 2, 3, 4]
    assert NgramDrafter(LookaheadOptions(draft_len=2), context).draft(10) == [9, 9]
    assert NgramDrafter(LookaheadOptions(draft_len=2, max_ngram=2), context).draft(10) == [7, 7]


def test_a_miss_pauses_drafting_longer_each_time():
    drafter = NgramDrafter(LookaheadOptions(draft_len=2, min_ngram=1, max_backoff=4), [1, 2, 1])
    assert drafter.draft(5) == [2, 1]
    drafter.accepted(0)
    assert drafter.draft(5) == [] and drafter.draft(5) == [2, 1]
    drafter.accepted(0)
    assert [drafter.draft(5) for _ in range(3)] == [[], [], [2, 1]]
    drafter.accepted(1)  # a hit resets the pause
    assert drafter.draft(5) == [2, 1]


# What a call of 1..8 rows cost on the AVX2 host, in decode steps (a 4-bit program; docs/decisions/0028):
# the cost rises in steps, with XNNPACK's row tiles.
AVX2 = [1.00, 1.68, 1.81, 2.65, 2.89, 2.99, 4.30, 4.31]


def sizer_with(costs, history=()):
    sizer = DraftSizer(7)
    for rows, seconds in enumerate(costs, 1):
        sizer.timed(rows, seconds)
    for drafted, kept in history:
        sizer.scored(drafted, kept)
    return sizer


def test_drafts_are_checked_whole_where_rows_cost_little():
    assert sizer_with([1.0 + 0.04 * rows for rows in range(8)]).size(7, lambda n: n) == 7
    assert DraftSizer(7).size(7, lambda n: n) == 7  # nothing timed yet


def test_where_each_row_costs_nearly_a_step_the_drafts_that_pay_are_checked():
    rows = lambda n: n  # noqa: E731
    assert sizer_with(AVX2).size(7, rows) == 2  # 3 rows at 1.81: kept 3 in 4 a position, they pay best
    assert sizer_with(AVX2, [(7, 7)] * 10).size(7, rows) == 5  # copying: 6 rows at 2.99 beat 8 at 4.31
    assert sizer_with(AVX2, [(7, 7)] * 10).size(3, rows) == 2  # a short draft: 4 rows cost more than 3
    assert sizer_with(AVX2, [(7, 7)] * 10).size(7, lambda n: 8) == 7  # a padded verify: all rows paid anyway
    assert sizer_with(AVX2[:1]).size(7, rows) == 7  # a length never timed costs no more than a step, until it is


def test_after_misses_a_short_call_is_chosen():
    assert sizer_with(AVX2, [(2, 0)] * 10).size(7, lambda n: n) <= 2  # 2 or 3 rows: the least paid for a likely miss
    assert sizer_with(AVX2, [(2, 0)] * 10).size(7, lambda n: 8) == 7  # padded: any length costs 8 rows


def test_drafts_are_scored_whole_once_their_tokens_come():
    sizer = DraftSizer(4)
    sizer.drafted([5, 6, 7, 8], at=2)
    sizer.came([1, 2, 5, 6])  # right so far, the rest not come yet: undecided
    assert sizer.tried == [0, 0, 0, 0]
    sizer.came([1, 2, 5, 6, 7, 9])  # the third right, the fourth missed
    assert sizer.tried == [1, 1, 1, 1] and sizer.kept == [1, 1, 1, 0] and not sizer.open
    sizer.drafted([3, 4], at=6)
    sizer.came([1, 2, 5, 6, 7, 9, 8])  # a miss at once decides it
    assert sizer.tried == pytest.approx([1.8, 0.8, 0.8, 0.8]) and sizer.kept == pytest.approx([0.8, 0.8, 0.8, 0])


def test_short_calls_learn_from_the_unchecked_tail_that_the_text_is_copied():
    sizer = sizer_with(AVX2, [(7, 2)] * 10)  # drafts kept 2 tokens: calls of 3 rows pay
    text, at, sizes = list(range(100)), 10, []
    for _ in range(10):  # now every draft is right, though only its head is checked
        sizer.drafted(text[at : at + 7], at)
        sizes.append(sizer.size(7, lambda n: n))
        at += sizes[-1] + 1
        sizer.came(text[:at])
    assert sizes[0] == 2 and sizes[-1] == 5  # 6 rows at 2.99 steps for 6 tokens


def test_a_length_never_timed_costs_what_a_shorter_call_did():
    sizer = sizer_with([1.0, 2.0])
    sizer.timed(6, 3.0)
    assert [sizer.cost(rows) for rows in (1, 2, 5, 6, 8)] == [1.0, 2.0, 2.0, 3.0, 3.0]
    assert DraftSizer(3).cost(4) is None


def test_bad_lookahead_options():
    with pytest.raises(InputError):
        LookaheadOptions(draft_len=-1)
    with pytest.raises(InputError):
        LookaheadOptions(min_ngram=3, max_ngram=2)
