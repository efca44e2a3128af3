"""bench: load time, prefill and decode speed, peak memory and bandwidth use of a program.

Medians over repeats after one warm-up round. The decode rate excludes the first generated
token (it comes from prefill). The bandwidth share compares the bytes of weights a decode step
must read (every weight but the token embedding, of which it reads one row) times the decode
rate with the machine's copy bandwidth, measured here with numpy on every core.

With `lookahead`, each round also generates from the prompt with plain decoding and then with
lookahead decoding replaying plain decoding's text (its sampler returns plain's tokens in turn), so
the rates compare the same tokens: a near-tie that a verify call rounds the other way (8da4w
programs, docs/decisions/0030) would otherwise send lookahead down another text, more or less repetitive,
and the ratio would compare texts, not decoders. One free lookahead generation after the rounds
says where its own greedy text first differs. Both rates are reported, and the tokens each decode
call gave. Lookahead needs text that repeats, so `prompt_file` gives the prompt (with `chat`, as a
user message through the folder's chat template, and generation stops at an end-of-turn token);
random ids draft next to nothing.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from genai_pipeline.bench.host import current_rss_mb, memory_bandwidth_gbs, peak_rss_mb
from genai_pipeline.errors import InputError
from genai_pipeline.inspect import inspect_program
from genai_pipeline.limits import read_input_text
from genai_pipeline.options import BenchOptions
from genai_pipeline.runtime.generate import generate, greedy_token
from genai_pipeline.runtime.lookahead import LookaheadOptions, lookahead_options
from genai_pipeline.runtime.open import open_session
from genai_pipeline.runtime.program import set_threads
from genai_pipeline.runtime.session import DecoderSession


def embedding_table_bytes(manifest: dict) -> int:
    """The token-embedding table's bytes in the program, values and scales; a step reads one row."""
    config, quantization = manifest["config"], manifest.get("quantization") or {}
    values = config["vocab_size"] * config["dim"]
    if quantization.get("embedding") == "4w":  # two values a byte, an fp32 scale per group
        return values // 2 + values // quantization["group_size"] * 4
    if quantization.get("embedding") == "8w":  # a byte a value, an fp32 scale per row
        return values + config["vocab_size"] * 4
    return values * 4


def weight_bytes_per_token(folder: Path, manifest: dict) -> int:
    report = inspect_program(Path(folder) / manifest["artifacts"]["text_decoder"]["file"])
    stored = report["named_data"]["bytes"] + report["constant_segment"]["bytes"]
    return stored - embedding_table_bytes(manifest)


def timed_decode(session, token: int, gen_len: int) -> float:
    """Tokens per second of `gen_len` greedy decode steps from `token`."""
    t = time.perf_counter()
    for _ in range(gen_len):
        token = greedy_token(session.step(token))
    return gen_len / (time.perf_counter() - t)


def bench(folder: Path, options: BenchOptions) -> dict:
    if options.threads:
        set_threads(options.threads)
    rss_before_load_mb = current_rss_mb()  # the libraries: what the program adds is peak_rss_mb minus this
    start = time.perf_counter()
    session = open_session(Path(folder), verify=True)  # a corrupt program measures nothing
    load_s = time.perf_counter() - start
    prompt, stop_ids = bench_prompt(Path(folder), session, options)
    if len(prompt) + options.gen_len > session.max_seq_len:
        what = (
            f"--prompt-len + --gen-len = {len(prompt) + options.gen_len}"
            if options.prompt_file is None
            else f"the prompt ({len(prompt)} tokens) + --gen-len {options.gen_len}"
        )
        raise InputError(f"{what} exceeds the program's context {session.max_seq_len}")
    lookahead = lookahead_options(options.lookahead, session) if options.lookahead else None
    rounds = []
    prefill, decode = [], []
    for _ in range(options.repeats + 1):  # the first round warms up
        session.reset()
        t = time.perf_counter()
        logits = session.prefill(prompt)
        prefill.append(len(prompt) / (time.perf_counter() - t))
        decode.append(timed_decode(session, greedy_token(logits), options.gen_len))
        if lookahead is not None:
            plain = _generate(session, prompt, options.gen_len, stop_ids, LookaheadOptions())
            rounds.append(
                [
                    plain,
                    _generate(session, prompt, options.gen_len, stop_ids, lookahead, replay_sampler(plain, stop_ids)),
                ]
            )
    if lookahead is not None:
        free = _generate(session, prompt, options.gen_len, stop_ids, lookahead)
    decode_rate = statistics.median(decode[1:])
    # Taken before the bandwidth probe below, whose 512 MB of buffers are not the runtime's.
    peak_rss = peak_rss_mb()
    weights = weight_bytes_per_token(folder, session.manifest)
    bandwidth = memory_bandwidth_gbs()
    return {
        "model": session.manifest["model"],
        "mode": session.manifest["mode"],
        "recipe": session.manifest.get("recipe", "fp32"),
        "threads": options.threads or None,
        "prompt_len": len(prompt),
        "gen_len": options.gen_len,
        "load_s": round(load_s, 3),
        "prefill_tokens_per_s": round(statistics.median(prefill[1:]), 1),
        "decode_tokens_per_s": round(decode_rate, 1),
        "peak_rss_mb": round(peak_rss, 1),
        "rss_before_load_mb": round(rss_before_load_mb, 1),
        "weight_bytes_per_token": weights,
        "memory_bandwidth_gbs": round(bandwidth, 2),
        "bandwidth_share": round(weights * decode_rate / (bandwidth * 1e9), 4),
        **({"lookahead": _lookahead_figures(rounds[1:], lookahead, free)} if lookahead is not None else {}),
    }


def bench_prompt(folder: Path, session: DecoderSession, options: BenchOptions) -> tuple[list[int], tuple[int, ...]]:
    """The prompt's ids, and the ids that end generation (only for a chat prompt)."""
    if options.prompt_file is None:
        vocab = session.manifest["config"]["vocab_size"]
        return torch.randint(1, vocab, (options.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist(), ()
    from genai_pipeline.bundle import folder_tokenizer

    text = read_input_text(options.prompt_file, "--prompt-file")
    tokenizer = folder_tokenizer(folder, session.manifest)
    if not options.chat:
        return tokenizer.encode(text), ()
    from genai_pipeline.chat_template import read_chat_template
    from genai_pipeline.messages import Message
    from genai_pipeline.runtime.chat import Chat, end_of_turn_ids

    template = read_chat_template(folder)
    if template is None:
        raise InputError(f"'{folder}' has no chat template for --chat")
    stop_ids = end_of_turn_ids(folder, tokenizer, session.manifest.get("eos_ids", ()), template)
    chat = Chat(session, tokenizer, template, greedy_token, stop_ids, 1)
    return chat.render((Message("user", text),)), stop_ids


def _generate(
    session: DecoderSession,
    prompt: list[int],
    gen_len: int,
    stop_ids,
    lookahead: LookaheadOptions,
    sampler=greedy_token,
):
    session.reset()
    return generate(session, prompt, gen_len, sampler, stop_ids, lookahead=lookahead)


def replay_sampler(plain, stop_ids):
    """A sampler that returns `plain`'s tokens in turn (and the end of turn where it stopped)."""
    tokens = iter([*plain.tokens, *stop_ids[:1]])
    return lambda logits: next(tokens)


def _lookahead_figures(rounds: list, options: LookaheadOptions, free) -> dict:
    """Medians over rounds of (plain, lookahead replaying plain's tokens) generations; `free`: a
    lookahead generation that chose its own greedy tokens."""
    plain = [p.decode_tokens_per_s for p, _ in rounds]
    ahead = [a.decode_tokens_per_s for _, a in rounds]
    plain_last, last = rounds[-1]
    # Greedy lookahead gives plain decoding's tokens when `verify` computes decode's logits. In
    # 8da4w programs the two call lengths may round differently, and dynamic activation
    # quantization amplifies that (SmolLM2-135M: up to ~1 in a logit, at some positions):
    # then a near-tie can go the other way. Reported, not hidden.
    same = next((i for i, (p, a) in enumerate(zip(plain_last.tokens, free.tokens)) if p != a), None)
    if same is None and len(plain_last.tokens) != len(free.tokens):
        same = min(len(plain_last.tokens), len(free.tokens))
    return {
        "draft_len": options.draft_len,
        "tokens": len(last.tokens),
        "plain_decode_tokens_per_s": round(statistics.median(plain), 1),
        "decode_tokens_per_s": round(statistics.median(ahead), 1),
        "speedup": round(statistics.median(a / p for p, a in zip(plain, ahead)), 3),
        "tokens_per_call": round(last.tokens_per_call, 3),
        "verify_calls": last.verify_calls,
        "drafted": last.drafted,
        "accepted": last.accepted,
        "verify_cost_in_steps": round(statistics.median(a.verify_cost_in_steps for _, a in rounds), 2),
        "plain_tokens": len(plain_last.tokens),
        "first_difference": same,  # index of the first token that differs from plain decoding, None: identical
    }
