"""`genai run`: a prompt's completion, or with --chat a conversation (chat.py). The runtime is imported
when the command runs: `genai --help` loads no torch."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from genai_pipeline.cli.chat import chat
from genai_pipeline.errors import InputError
from genai_pipeline.options import SamplingOptions

log = logging.getLogger("genai_pipeline")


def cmd_run(args) -> int:
    from genai_pipeline.runtime.generate import Sampler, generate
    from genai_pipeline.runtime.lookahead import lookahead_options
    from genai_pipeline.runtime.multimodal import MultimodalSession
    from genai_pipeline.runtime.open import open_session
    from genai_pipeline.tokenizer import TextStream

    if args.chat and args.json:
        raise InputError("--json does not apply to --chat")
    if not args.chat and args.prompt is None:
        raise InputError("--prompt TEXT is required (or pass --chat for a conversation on stdin)")
    if not args.chat and args.system is not None:
        raise InputError("--system needs --chat")
    sampling = SamplingOptions(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    images, audio = [Path(p) for p in args.image], [Path(p) for p in args.audio]
    session = open_session(Path(args.folder), verify=not args.no_verify)
    modality = session.modality if isinstance(session, MultimodalSession) else "text"
    kinds = {"text": "text-only", "image": "vision-language", "audio": "speech"}
    for given, flag, wanted in ((images, "--image", "image"), (audio, "--audio", "audio")):
        if given and modality != wanted:
            raise InputError(f"'{args.folder}' holds a {kinds[modality]} model: it cannot take {flag}")
    tokenizer = session.manifest.tokenizer(Path(args.folder))
    lookahead = lookahead_options(args.lookahead, session)
    if args.chat:
        return chat(args, session, tokenizer, Sampler(sampling), lookahead)
    if isinstance(session, MultimodalSession):
        prompt = session.encode_prompt(tokenizer, args.prompt, images or audio, args.max_tiles)
    else:
        prompt = tokenizer.encode(args.prompt)
    if len(prompt) >= session.max_seq_len:
        raise InputError(
            f"the prompt is {len(prompt)} tokens but the program's context is {session.max_seq_len}; "
            "shorten it or re-export with a larger --max-seq-len"
        )
    room = session.max_seq_len - len(prompt) + 1  # the last generated token is never fed back
    max_new = min(args.max_new_tokens, room)
    if max_new < args.max_new_tokens:
        log.warning("only %d new tokens fit the context of %d", max_new, session.max_seq_len)
    stream = TextStream(tokenizer)

    def show(token: int) -> None:
        if not args.json:
            print(stream.push(token), end="", flush=True)

    result = generate(session, prompt, max_new, Sampler(sampling), session.manifest.eos_ids, show, lookahead)
    text = tokenizer.decode(result.tokens)
    if args.json:
        print(
            json.dumps(
                {
                    "prompt_tokens": result.prompt_tokens,
                    "tokens": result.tokens,
                    "text": text,
                    "stop_reason": result.stop_reason,
                    "prefill_tokens_per_s": round(result.prefill_tokens_per_s, 2),
                    "decode_tokens_per_s": round(result.decode_tokens_per_s, 2),
                    "tokens_per_call": round(result.tokens_per_call, 3),
                    **(
                        {
                            f"{session.modality}_tokens": prompt.count(session.media_token_id),
                            f"{'vision' if session.modality == 'image' else 'audio'}_encoder_ms": round(
                                session.vision_seconds * 1e3, 2
                            ),
                        }
                        if isinstance(session, MultimodalSession)
                        else {}
                    ),
                }
            )
        )
    else:
        print(stream.flush(), flush=True)
        log.info(
            "%d prompt tokens at %.1f tok/s, %d new tokens at %.1f tok/s (%s)",
            len(prompt),
            result.prefill_tokens_per_s,
            len(result.tokens),
            result.decode_tokens_per_s,
            result.stop_reason,
        )
        if lookahead.draft_len:
            log.info(
                "lookahead: %.2f tokens per call, %d of %d drafted tokens kept",
                result.tokens_per_call,
                result.accepted,
                result.drafted,
            )
    return 0
