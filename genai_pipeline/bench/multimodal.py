"""bench, for a vision-language program: image encode time, time to first token with one image,
prefill and decode speed, peak memory.

The image is one frame of the encoder's input size (evaluate.report_image: no resizing, no tiles),
expanded in the prompt as the family's processor expands an image, followed by `prompt_len` text
ids (seeded random ids, none of them the image token). Each round after one warm-up round:
`vision_encoder` on the frame (image encode), the whole prompt through `token_embedding` + image
splice + `text_decoder` (time to first token: encode included), then `gen_len` greedy decode steps.
Prefill speed: the prompt's tokens (the image's included) over the time to first token less the
encode's, as a text program's prefill (token embedding and decoder). Medians over `repeats` rounds.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from genai_pipeline.bench.host import current_rss_mb, peak_rss_mb
from genai_pipeline.bench.text import timed_decode
from genai_pipeline.errors import InputError
from genai_pipeline.image_processing import Frames, expand_prompt
from genai_pipeline.manifest import Manifest
from genai_pipeline.options import BenchOptions
from genai_pipeline.runtime.generate import greedy_token
from genai_pipeline.runtime.multimodal import MultimodalSession
from genai_pipeline.runtime.program import set_threads


def _prompt(folder: Path, session: MultimodalSession, frame, text_len: int) -> list[int]:
    tokenizer = session.manifest.tokenizer(folder)
    ids = tokenizer.encode(expand_prompt("", [Frames((frame,), 0, 0)], session.processing))
    vocab = session.manifest.config.vocab_size
    text = torch.randint(1, vocab, (text_len,), generator=torch.Generator().manual_seed(0))
    text[text == session.image_token_id] = 1  # an image token would ask for a second image
    return ids + text.tolist()


def bench_multimodal(folder: Path, options: BenchOptions) -> dict:
    from genai_pipeline.evaluate.text import report_image

    Manifest.read(Path(folder)).refuse_speech(Path(folder), "genai bench")
    if options.lookahead or options.prompt_file is not None:
        raise InputError(
            "--lookahead and --prompt-file are for text programs; a vision-language bench takes --prompt-len text ids"
        )
    if options.threads:
        set_threads(options.threads)
    folder = Path(folder)
    rss_before_load_mb = current_rss_mb()
    start = time.perf_counter()
    session = MultimodalSession(folder, verify=True)  # a corrupt program measures nothing
    load_s = time.perf_counter() - start
    frame = report_image(session.processing.tile_size)[0].numpy()
    prompt = _prompt(folder, session, frame, options.prompt_len)
    if len(prompt) + options.gen_len > session.max_seq_len:
        raise InputError(
            f"the image's {len(prompt) - options.prompt_len} tokens + --prompt-len {options.prompt_len} + "
            f"--gen-len {options.gen_len} = {len(prompt) + options.gen_len} exceed the program's context {session.max_seq_len}"
        )
    encode, first_token, prefill, decode = [], [], [], []
    for _ in range(options.repeats + 1):  # the first round warms up
        session.reset()
        session.frames = [frame]
        t = time.perf_counter()
        token = greedy_token(session.prefill(prompt))
        first_token.append(time.perf_counter() - t)
        encode.append(session.vision_seconds)
        prefill.append(len(prompt) / (first_token[-1] - encode[-1]))
        decode.append(timed_decode(session, token, options.gen_len))
    peak_rss = peak_rss_mb()
    return {
        "model": session.manifest.model,
        "recipe": session.manifest.recipe,
        "threads": options.threads or None,
        "image_size": session.processing.tile_size,
        "image_tokens": prompt.count(session.image_token_id),
        "prompt_len": len(prompt),
        "gen_len": options.gen_len,
        "repeats": options.repeats,
        "load_s": round(load_s, 3),
        "image_encode_ms": round(1e3 * statistics.median(encode[1:]), 2),
        "time_to_first_token_ms": round(1e3 * statistics.median(first_token[1:]), 2),
        "prefill_tokens_per_s": round(statistics.median(prefill[1:]), 1),
        "decode_tokens_per_s": round(statistics.median(decode[1:]), 1),
        "peak_rss_mb": round(peak_rss, 1),
        "rss_before_load_mb": round(rss_before_load_mb, 1),
    }
