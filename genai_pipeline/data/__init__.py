"""Calibration data for post-training quantization, read from local files only.

    records.py        JSON / JSON-lines records with their position, for errors
    loaders.py        `text` and `messages` datasets
    hf_chat.py        `hf-chat`: a `datasets` folder (parquet, arrow, jsonl)
    lm_eval.py        `lm-eval`: an lm-evaluation-harness task's cached documents
    collate.py        collate: token ids -> CalibrationSteps (chunks as inference feeds them)
    calibration.py    calibration_tokens / calibration_steps: options -> all of the above; render_sample:
                      Sample -> token ids (through the model's chat template, genai_pipeline/chat_template.py)

A sample's messages are genai_pipeline/messages.py's (shared with the chat template and the runtime's
chat). What to read is CalibrationOptions (genai_pipeline/options.py: `--calib NAME:ARG` -> DatasetSpec).

Typical use by the quantize stage, once per graph:

    steps = calibration_steps(options, tokenizer, chunk_len=prefill_len, max_seq_len=max_seq_len,
                              vocab_size=config.vocab_size, chat_template=...)
    for step in iterate_with_progress(steps, "calibrating prefill"):
        if step.reset_cache: ...  # a new sample: the KV cache starts empty
        model(step.tokens, step.input_pos)
"""

from genai_pipeline.data.calibration import LOADERS, calibration_steps, calibration_tokens, load_dataset, render_sample
from genai_pipeline.data.collate import (
    CalibrationStep,
    check_seq_len,
    collate,
    iterate_with_progress,
    random_token_lists,
)
from genai_pipeline.messages import ContentPart, Message, Sample

__all__ = [
    "LOADERS",
    "CalibrationStep",
    "ContentPart",
    "Message",
    "Sample",
    "calibration_steps",
    "calibration_tokens",
    "check_seq_len",
    "collate",
    "iterate_with_progress",
    "load_dataset",
    "random_token_lists",
    "render_sample",
]
