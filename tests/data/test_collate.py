"""The collator walks each sample in chunks at increasing positions, as inference does."""

import logging

import pytest
import torch

from genai_pipeline.data import CalibrationStep, collate, iterate_with_progress, random_token_lists
from genai_pipeline.errors import DataError, InputError


def _walk(steps):
    return [(s.input_pos.item(), s.tokens[0].tolist(), s.n_real, s.reset_cache) for s in steps]


def test_chunks_positions_padding_and_resets():
    steps = collate([[1, 2, 3, 4, 5, 6, 7], [8, 9]], chunk_len=3, max_seq_len=16, seq_len=15, vocab_size=10)
    assert _walk(steps) == [
        (0, [1, 2, 3], 3, True),
        (3, [4, 5, 6], 3, False),
        (6, [7, 0, 0], 1, False),
        (0, [8, 9, 0], 2, True),
    ]
    step = steps[0]
    assert step.tokens.dtype == step.input_pos.dtype == torch.long
    assert tuple(step.tokens.shape) == (1, 3) and tuple(step.input_pos.shape) == (1,)


def test_decode_graph_takes_one_token_per_step():
    steps = collate([[5, 6, 7]], chunk_len=1, max_seq_len=8, seq_len=8, vocab_size=10)
    assert _walk(steps) == [(0, [5], 1, True), (1, [6], 1, False), (2, [7], 1, False)]


def test_long_samples_are_truncated_to_seq_len(caplog):
    with caplog.at_level(logging.INFO, logger="genai_pipeline.data.collate"):
        steps = collate([list(range(1, 30)), [1, 2]], chunk_len=4, max_seq_len=12, seq_len=6, vocab_size=32)
    assert _walk(steps)[:3] == [(0, [1, 2, 3, 4], 4, True), (4, [5, 6, 0, 0], 2, False), (0, [1, 2, 0, 0], 2, True)]
    assert "1 of 2 calibration samples truncated" in caplog.text


def test_seq_len_must_fit_the_context_in_whole_chunks():
    collate([[1]], chunk_len=4, max_seq_len=12, seq_len=12, vocab_size=8)  # exactly fits
    with pytest.raises(InputError) as e:
        collate([[1]], chunk_len=4, max_seq_len=14, seq_len=13, vocab_size=8)  # 4 chunks = 16 positions
    assert "--calib-seq-len 13" in str(e.value) and "context of 14" in str(e.value) and "12 or less" in str(e.value)
    with pytest.raises(InputError, match="chunk length"):
        collate([[1]], chunk_len=20, max_seq_len=14, seq_len=4, vocab_size=8)


def test_token_outside_the_vocabulary_names_the_sample():
    with pytest.raises(DataError) as e:
        collate([[1, 2], [3, 99]], chunk_len=2, max_seq_len=8, seq_len=8, vocab_size=50)
    assert "sample 1" in str(e.value) and "token id 99" in str(e.value) and "vocabulary of 50" in str(e.value)


def test_empty_sample_and_no_samples():
    with pytest.raises(DataError, match="sample 1 has no tokens"):
        collate([[1], []], chunk_len=2, max_seq_len=8, seq_len=8, vocab_size=8)
    with pytest.raises(DataError, match="no calibration samples"):
        collate([], chunk_len=2, max_seq_len=8, seq_len=8, vocab_size=8)


def test_random_tokens_are_reproducible_and_in_range(caplog):
    with caplog.at_level(logging.WARNING):
        a = random_token_lists(3, seq_len=50, vocab_size=7, seed=1)
    assert "RANDOM" not in caplog.text  # the quantize stage warns when it calibrates on them, not the data layer
    assert (
        a
        == random_token_lists(3, seq_len=50, vocab_size=7, seed=1)
        != random_token_lists(3, seq_len=50, vocab_size=7, seed=2)
    )
    assert len(a) == 3 and all(len(ids) == 50 for ids in a)
    assert {t for ids in a for t in ids} == set(range(1, 7))  # never 0, the padding id


def test_step_validation():
    with pytest.raises(ValueError):
        CalibrationStep(torch.zeros(4, dtype=torch.long), torch.tensor([0]), 4, True)
    with pytest.raises(ValueError):
        CalibrationStep(torch.zeros(1, 4, dtype=torch.long), torch.tensor([0]), 0, True)


def test_progress_yields_every_step():
    steps = collate([[1, 2, 3]], chunk_len=2, max_seq_len=4, seq_len=4, vocab_size=4)
    assert list(iterate_with_progress(steps, "calibrating")) == steps
