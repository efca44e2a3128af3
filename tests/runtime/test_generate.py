"""Sampling and the generation loop, on a scripted model whose logits we choose."""

import pytest
import torch

from genai_pipeline.errors import InputError
from genai_pipeline.options import SamplingOptions
from genai_pipeline.runtime.generate import Sampler, generate, greedy_token


class Scripted:
    """Always prefers token `(last + 1) % vocab`; logs what it was fed."""

    def __init__(self, vocab=10):
        self.vocab, self.fed = vocab, []

    def _logits(self, last):
        logits = torch.zeros(self.vocab)
        logits[(last + 1) % self.vocab] = 5.0
        return logits

    def prefill(self, tokens):
        self.fed += tokens
        return self._logits(tokens[-1])

    def step(self, token):
        self.fed.append(token)
        return self._logits(token)


def test_greedy_stops_at_eos_and_never_feeds_the_last_token():
    model = Scripted()
    result = generate(model, [1, 2], 100, Sampler(SamplingOptions()), eos_ids=(7,))
    assert result.tokens == [3, 4, 5, 6] and result.stop_reason == "eos"
    assert model.fed == [1, 2, 3, 4, 5, 6]


def test_length_limit():
    model = Scripted()
    result = generate(model, [0], 3, Sampler(SamplingOptions()))
    assert result.tokens == [1, 2, 3] and result.stop_reason == "length"
    assert model.fed == [0, 1, 2]


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    sample = Sampler(SamplingOptions(temperature=5.0, top_k=1, seed=3))
    assert {sample(logits) for _ in range(20)} == {int(logits.argmax())}


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sample = Sampler(SamplingOptions(temperature=1.0, top_p=0.7, seed=0))
    assert {sample(logits) for _ in range(200)} == {0, 1}


@pytest.mark.parametrize("top_p, expected", [(1.0, [0.5, 0.3, 0.15, 0.05]), (0.7, [0.625, 0.375, 0.0, 0.0])])
def test_draws_follow_the_probabilities(top_p, expected):
    # Oracle: the distribution itself (renormalized over the nucleus); 4000 draws put each
    # frequency within 0.03 of its probability with overwhelming odds (3 sigma < 0.024).
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sample = Sampler(SamplingOptions(temperature=1.0, top_p=top_p, seed=1))
    counts = torch.bincount(torch.tensor([sample(logits) for _ in range(4000)]), minlength=4)
    assert torch.allclose(counts / 4000, torch.tensor(expected), atol=0.03)


def test_greedy_takes_the_first_of_tied_maxima_as_torch_does():
    logits = torch.tensor([[0.0, 2.0, -1.0, 2.0]])
    assert greedy_token(logits) == int(torch.argmax(logits)) == 1
    assert greedy_token(logits.to(torch.bfloat16)) == 1


def test_seed_makes_sampling_reproducible():
    logits = torch.zeros(1000)

    def draws(seed):
        sample = Sampler(SamplingOptions(temperature=1.0, seed=seed))
        return [sample(logits) for _ in range(10)]

    assert draws(42) == draws(42)
    assert draws(42) != draws(43)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0), dict(top_p=1.5)])
def test_bad_sampling_options(bad):
    with pytest.raises(InputError):
        SamplingOptions(**bad)
