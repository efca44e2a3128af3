"""Token lists -> the calls a graph sees at inference: fixed-size chunks at increasing positions.

For each sample (its first `seq_len` tokens), the collator emits one CalibrationStep per chunk of
`chunk_len` tokens (the graph's static token count: the prefill length, or 1 for `decode_token`), at
`input_pos` = the chunk's first position in the sample. The last chunk is padded at the end with
0s, as `genai run` pads a prompt (`n_real` counts its real tokens), and the first chunk of each
sample says `reset_cache`: every sample starts from an empty KV cache.

Long samples are truncated to `seq_len`, never rejected. What must fit is `seq_len` itself: every
chunk, padding included, writes `chunk_len` KV-cache rows, so `seq_len` rounded up to a whole
number of chunks must not exceed the context (`max_seq_len`); otherwise `collate` raises, naming
the largest `seq_len` that fits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from genai_pipeline.errors import DataError, InputError

log = logging.getLogger(__name__)

DEFAULT_RANDOM_SAMPLES = 8

T = TypeVar("T")


@dataclass(frozen=True)
class CalibrationStep:
    tokens: torch.Tensor  # int64 [1, chunk_len], padded with 0 past n_real
    input_pos: torch.Tensor  # int64 [1]: position of tokens[0, 0] in its sample
    n_real: int  # real (not padding) tokens at the start of `tokens`
    reset_cache: bool  # first chunk of a sample: clear the KV cache before this call

    def __post_init__(self):
        if self.tokens.dtype != torch.long or self.tokens.dim() != 2 or self.tokens.shape[0] != 1:
            raise ValueError(f"tokens must be int64 [1, chunk_len], got {self.tokens.dtype} {tuple(self.tokens.shape)}")
        if self.input_pos.dtype != torch.long or tuple(self.input_pos.shape) != (1,):
            raise ValueError(f"input_pos must be int64 [1], got {self.input_pos.dtype} {tuple(self.input_pos.shape)}")
        if not 1 <= self.n_real <= self.tokens.shape[1]:
            raise ValueError(f"n_real must be between 1 and {self.tokens.shape[1]}, got {self.n_real}")


def random_token_lists(count: int, *, seq_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`count` samples of `seq_len` token ids drawn uniformly from [1, vocab_size), reproducibly.
    The quantize stage warns when it calibrates on them; measuring a dynamic recipe's noise on
    them (the quantization report) is no cause for alarm."""
    if vocab_size < 2:
        raise InputError(f"random calibration needs a vocabulary of at least 2 tokens, got {vocab_size}")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab_size, (count, seq_len), generator=generator).tolist()


def check_seq_len(seq_len: int, *, chunk_len: int, max_seq_len: int) -> None:
    """`seq_len` tokens in chunks of `chunk_len`, padding included, fit a context of `max_seq_len`."""
    if not 1 <= chunk_len <= max_seq_len:
        raise InputError(f"the chunk length must be between 1 and the context ({max_seq_len}), got {chunk_len}")
    padded = -(-seq_len // chunk_len) * chunk_len
    if padded > max_seq_len:
        fits = max_seq_len // chunk_len * chunk_len
        raise InputError(
            f"--calib-seq-len {seq_len} in chunks of {chunk_len} fills {padded} cache positions, more than the "
            f"program's context of {max_seq_len}; use --calib-seq-len {fits} or less"
        )


def collate(
    token_lists: Sequence[Sequence[int]], *, chunk_len: int, max_seq_len: int, seq_len: int, vocab_size: int
) -> list[CalibrationStep]:
    """Every sample's first `seq_len` tokens as CalibrationSteps of `chunk_len` tokens (see the module doc)."""
    check_seq_len(seq_len, chunk_len=chunk_len, max_seq_len=max_seq_len)
    if not token_lists:
        raise DataError("no calibration samples to collate")
    steps = []
    truncated = 0
    for i, ids in enumerate(token_lists):
        ids = list(ids)
        if not ids:
            raise DataError(f"calibration sample {i} has no tokens")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise DataError(
                f"calibration sample {i} holds token id {bad}, outside the model's vocabulary of {vocab_size}; "
                "use the tokenizer that belongs to the checkpoint"
            )
        truncated += len(ids) > seq_len
        ids = ids[:seq_len]
        for start in range(0, len(ids), chunk_len):
            chunk = ids[start : start + chunk_len]
            steps.append(
                CalibrationStep(
                    tokens=torch.tensor([chunk + [0] * (chunk_len - len(chunk))], dtype=torch.long),
                    input_pos=torch.tensor([start], dtype=torch.long),
                    n_real=len(chunk),
                    reset_cache=start == 0,
                )
            )
    if truncated:
        log.info(
            "%d of %d calibration samples truncated to --calib-seq-len %d tokens", truncated, len(token_lists), seq_len
        )
    return steps


def iterate_with_progress(steps: Iterable[T], desc: str) -> Iterator[T]:
    """`steps`, with a tqdm bar on stderr when it is a terminal."""
    from tqdm import tqdm

    yield from tqdm(steps, desc=desc, unit="step", disable=None, leave=False)
