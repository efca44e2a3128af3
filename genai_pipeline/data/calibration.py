"""CalibrationOptions -> token lists -> CalibrationSteps: what the quantize stage calls.

The datasets of `--calib` are read in order and concatenated; `--calib-limit N` keeps the first N
samples of the concatenation (each loader stops reading once it has what is still wanted). A
`random` dataset has no samples: it adds `N` (or 8 without a limit) random token lists.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from genai_pipeline.chat_template import ChatTemplate, TextEncoder, render_chat
from genai_pipeline.data.collate import (
    DEFAULT_RANDOM_SAMPLES,
    CalibrationStep,
    check_seq_len,
    collate,
    random_token_lists,
)
from genai_pipeline.data.hf_chat import load_hf_chat
from genai_pipeline.data.lm_eval import load_lm_eval
from genai_pipeline.data.loaders import load_messages, load_text
from genai_pipeline.errors import DataError
from genai_pipeline.messages import Sample
from genai_pipeline.options import CalibrationOptions, DatasetSpec

LOADERS: dict[str, Callable[[Path, int | None], list[Sample]]] = {
    "text": load_text,
    "messages": load_messages,
    "hf-chat": load_hf_chat,
    "lm-eval": load_lm_eval,
}


def load_dataset(spec: DatasetSpec, limit: int | None = None) -> list[Sample]:
    """The samples of one file-backed dataset (at most `limit`); `random` has none to load."""
    if spec.kind not in LOADERS:
        raise ValueError(f"'{spec.kind}' has no samples to load; random_token_lists makes its token ids")
    return LOADERS[spec.kind](spec.path, limit)


def calibration_tokens(
    options: CalibrationOptions,
    tokenizer: TextEncoder | None,
    *,
    vocab_size: int,
    chat_template: ChatTemplate | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """Every sample of every dataset as token ids, in `--calib` order, the first `limit` of them.
    `tokenizer` may be None when every dataset is `random`."""
    if not options.datasets:
        raise DataError("no calibration data given; pass --calib text:FILE (or messages, hf-chat, lm-eval, random)")
    template, bos, eos = (
        (chat_template.source, chat_template.bos_token, chat_template.eos_token) if chat_template else (None,) * 3
    )
    tokens: list[list[int]] = []
    for i, spec in enumerate(options.datasets):
        wanted = None if options.limit is None else options.limit - len(tokens)
        if wanted == 0:
            break
        if spec.kind == "random":
            tokens += random_token_lists(
                wanted or DEFAULT_RANDOM_SAMPLES, seq_len=options.seq_len, vocab_size=vocab_size, seed=seed + i
            )
            continue
        if tokenizer is None:
            raise DataError(
                f"--calib {spec} needs the model's tokenizer, and the checkpoint has no tokenizer.json or tokenizer.model"
            )
        tokens += [
            render_sample(s, tokenizer, template, bos_token=bos, eos_token=eos) for s in load_dataset(spec, wanted)
        ]
    return tokens


def calibration_steps(
    options: CalibrationOptions,
    tokenizer: TextEncoder | None,
    *,
    chunk_len: int,
    max_seq_len: int,
    vocab_size: int,
    chat_template: ChatTemplate | None = None,
    seed: int = 0,
) -> list[CalibrationStep]:
    """The calls to make on one graph (`chunk_len` tokens each) to calibrate it on `options`' data."""
    check_seq_len(options.seq_len, chunk_len=chunk_len, max_seq_len=max_seq_len)  # before reading any data
    tokens = calibration_tokens(options, tokenizer, vocab_size=vocab_size, chat_template=chat_template, seed=seed)
    return collate(tokens, chunk_len=chunk_len, max_seq_len=max_seq_len, seq_len=options.seq_len, vocab_size=vocab_size)


def render_sample(
    sample: Sample,
    tokenizer: TextEncoder,
    chat_template: str | None = None,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> list[int]:
    """A sample's token ids, ready for the collator."""
    if sample.text is not None:
        return list(tokenizer.encode(sample.text))
    try:
        text = render_chat(sample.messages, chat_template, bos_token=bos_token, eos_token=eos_token)
    except DataError as e:
        raise DataError(f"{sample.origin or 'a chat sample'}: {e}") from None
    return list(tokenizer.encode(text, add_special_tokens=chat_template is None))
