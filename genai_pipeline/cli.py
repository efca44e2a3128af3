"""`genai models | export | run | eval | bench | inspect`. Options and their defaults come from the
dataclasses of options.py, which import no torch: `genai --help` answers at once."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path

from genai_pipeline import names
from genai_pipeline.errors import GenAIError, InputError
from genai_pipeline.options import (
    DEFAULT_MODEL,
    LONG_PREFILL_CHUNKS,
    BenchOptions,
    CalibrationOptions,
    EvalOptions,
    ImageEvalOptions,
    PrepareOptions,
    QnnOptions,
    QuantOptions,
    SamplingOptions,
    parse_override,
)

log = logging.getLogger("genai_pipeline")


def _quiet_libraries() -> None:
    """Keep library chatter that users cannot act on off the terminal (docs/cli.md, "Library noise")."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in ("torchao", "torch.utils._pytree", "root", "executorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)


def cmd_models(args) -> int:
    from genai_pipeline.registry import SPECS

    rows = [
        {
            "name": s.name,
            "family": s.family,
            "params": s.config.num_params + (s.vision.config.num_params if s.vision else 0),  # a VLM's image tower too
            "weights": "shipped" if s.checkpoint else "--checkpoint DIR",
            "default": s.name == DEFAULT_MODEL,
            "description": s.description,
        }
        for s in SPECS.values()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        params = f"{r['params'] / 1e6:.1f}M" if r["params"] < 1e9 else f"{r['params'] / 1e9:.2f}B"
        mark = " (default)" if r["default"] else ""
        print(f"{r['name']:<16} {r['family']:<8} {params:>8}  weights: {r['weights']:<17} {r['description']}{mark}")
    return 0


def cmd_export(args) -> int:
    from genai_pipeline.export import export
    from genai_pipeline.targets import get_target

    target = _qnn_configured(get_target(args.target), args)  # QNN options checked before any work
    quant = QuantOptions(
        recipe=args.recipe,
        group_size=args.group_size,
        embedding=args.embedding,
        overrides=tuple(parse_override(o) for o in args.quant_override),
        block_size=args.block_size,
        calibration=CalibrationOptions(datasets=tuple(args.calib), limit=args.calib_limit, seq_len=args.calib_seq_len),
        vision_recipe=args.vision_recipe,
        size_budget=args.size_budget,
    )
    options = PrepareOptions(
        mode=args.mode,
        max_seq_len=args.max_seq_len,
        prefill_len=args.prefill_len,
        verify_len=args.verify_len,
        long_prefill_len=args.long_prefill_len,
        checkpoint=Path(args.checkpoint) if args.checkpoint else None,
        seed=args.seed,
        split=args.split,
        cache_io=args.cache_io or target.cache_io,
    )
    previous = signal.signal(signal.SIGTERM, _terminated)  # as Ctrl-C: the export's staging folder is removed
    try:
        result = export(args.model, out=args.out, prepare=options, quant=quant, target=target)
    finally:
        signal.signal(signal.SIGTERM, previous)
    log.info("wrote %s in %.1f s", result.folder, result.manifest["export_seconds"])
    for name, f in result.manifest["files"].items():
        log.info("  %s  %.2f MB", name, f["bytes"] / (1 << 20))
    return 0


def _terminated(signum, frame):
    raise KeyboardInterrupt


def _qnn_configured(target, args):
    """The target with the QNN options applied; a QNN option given for another target is refused."""
    from genai_pipeline.names import Mode
    from genai_pipeline.targets import qnn

    given = [flag for flag, on in (("--soc", args.soc != _default(QnnOptions, "soc")), ("--qnn-option", args.qnn_option),
                                   ("--no-weight-sharing", args.no_weight_sharing), ("--qnn-x86-emulator", args.qnn_x86_emulator)) if on]
    if target.name != qnn.TARGET.name:
        if given:
            raise InputError(f"{given[0]} applies to --target qnn only (the target is {target.name})")
        return target
    options = QnnOptions(soc=args.soc, weight_sharing=not args.no_weight_sharing, x86_emulator=args.qnn_x86_emulator,
                         options=tuple(args.qnn_option))
    return qnn.configure(options, [g.value for g in Mode(args.mode).graphs])


def cmd_run(args) -> int:
    from genai_pipeline.bundle import folder_tokenizer, read_manifest
    from genai_pipeline.runtime.generate import Sampler, generate
    from genai_pipeline.runtime.lookahead import lookahead_options
    from genai_pipeline.runtime.multimodal import MultimodalSession, is_multimodal
    from genai_pipeline.runtime.open import open_session
    from genai_pipeline.tokenizer import TextStream

    if args.chat and args.json:
        raise InputError("--json does not apply to --chat")
    if not args.chat and args.prompt is None:
        raise InputError("--prompt TEXT is required (or pass --chat for a conversation on stdin)")
    if not args.chat and args.system is not None:
        raise InputError("--system needs --chat")
    sampling = SamplingOptions(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    images = [Path(p) for p in args.image]
    if is_multimodal(read_manifest(Path(args.folder))):
        session = MultimodalSession(Path(args.folder), verify=not args.no_verify)
    elif images:
        raise InputError(f"'{args.folder}' holds a text-only model: it cannot take --image")
    else:
        session = open_session(Path(args.folder), verify=not args.no_verify)
    tokenizer = folder_tokenizer(Path(args.folder), session.manifest)
    lookahead = lookahead_options(args.lookahead, session)
    if args.chat:
        return _chat(args, session, tokenizer, Sampler(sampling), lookahead)
    if isinstance(session, MultimodalSession):
        prompt = session.encode_prompt(tokenizer, args.prompt, images, args.max_tiles)
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

    result = generate(session, prompt, max_new, Sampler(sampling), tuple(session.manifest.get("eos_ids", ())), show, lookahead)
    text = tokenizer.decode(result.tokens)
    if args.json:
        print(json.dumps({
            "prompt_tokens": result.prompt_tokens,
            "tokens": result.tokens,
            "text": text,
            "stop_reason": result.stop_reason,
            "prefill_tokens_per_s": round(result.prefill_tokens_per_s, 2),
            "decode_tokens_per_s": round(result.decode_tokens_per_s, 2),
            "tokens_per_call": round(result.tokens_per_call, 3),
            **({"image_tokens": prompt.count(session.image_token_id), "vision_encoder_ms": round(session.vision_seconds * 1e3, 2)}
               if isinstance(session, MultimodalSession) else {}),
        }))
    else:
        print(stream.flush(), flush=True)
        log.info(
            "%d prompt tokens at %.1f tok/s, %d new tokens at %.1f tok/s (%s)",
            len(prompt), result.prefill_tokens_per_s, len(result.tokens), result.decode_tokens_per_s, result.stop_reason,
        )
        if lookahead.draft_len:
            log.info("lookahead: %.2f tokens per call, %d of %d drafted tokens kept",
                     result.tokens_per_call, result.accepted, result.drafted)
    return 0


def _chat(args, session, tokenizer, sampler, lookahead) -> int:
    """`genai run --chat`: user messages from stdin (--prompt first), replies streamed to stdout."""
    from genai_pipeline.chat_template import read_chat_template
    from genai_pipeline.errors import ContextFullError, InputError
    from genai_pipeline.runtime.chat import Chat, end_of_turn_ids
    from genai_pipeline.tokenizer import TextStream

    folder = Path(args.folder)
    template = read_chat_template(folder)
    if template is None:
        raise InputError(
            f"'{folder}' has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json); "
            "write one there as chat_template.jinja, or export from a checkpoint that has one"
        )
    stop_ids = end_of_turn_ids(folder, tokenizer, session.manifest.get("eos_ids", ()), template)
    chat = Chat(session, tokenizer, template, sampler, stop_ids, args.max_new_tokens, system=args.system, lookahead=lookahead)
    for image in args.image:  # --image with --chat: for the first message
        chat.attach_image(Path(image), args.max_tiles)
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  line editing and history for input()

        log.info("chat with %s: %s/reset clears the conversation, /exit or Ctrl-D quits", session.manifest.get("model"),
                 "/image PATH attaches an image to your next message, " if chat.takes_images else "")
    for text in _user_messages(args.prompt, interactive):
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            chat.reset()
            log.info("conversation cleared")
            continue
        if text.strip().split(maxsplit=1)[:1] == ["/image"]:
            path = text.strip()[len("/image"):].strip()
            try:
                if not path:
                    raise InputError("/image needs a path: /image PATH")
                chat.attach_image(Path(path), args.max_tiles)
            except InputError as e:  # a bad file: one line, the conversation goes on
                log.warning("%s", e)
                continue
            log.info("%s goes with your next message", path)
            continue
        if not text.strip():
            continue
        stream = TextStream(tokenizer)
        try:
            reply = chat.send(text, on_token=lambda token: print(stream.push(token), end="", flush=True))
        except ContextFullError as e:
            log.warning("%s; /reset clears the conversation", e)
            continue
        except InputError as e:  # e.g. a template that does not mark images
            log.warning("%s", e)
            continue
        print(stream.flush(), flush=True)
        if reply.stop_reason == "context":
            log.warning("the reply filled the program's context of %d tokens; /reset clears the conversation",
                        session.max_seq_len)
        log.debug("kept %d cached tokens, prefilled %d, replied %d (%s)",
                  reply.reused, reply.prefilled, len(reply.tokens), reply.stop_reason)
    return 0


def _user_messages(first: str | None, interactive: bool):
    """--prompt, then stdin line by line until its end (Ctrl-D)."""
    if first is not None:
        yield first
    while True:
        try:
            yield input("> " if interactive else "")
        except EOFError:
            if interactive:
                print()  # the shell's prompt starts on a line of its own
            return


def cmd_eval(args) -> int:
    from genai_pipeline.evaluate import evaluate

    if (args.text is None) == (args.images is None):
        raise InputError("pass --text FILE (perplexity, top-1 agreement, KL) or --images FILE.jsonl (image questions), one of them")
    if args.images is not None:
        return _eval_images(args)
    if args.limit:
        raise InputError("--limit goes with --images (with --text, --max-tokens bounds the work)")
    result = evaluate(Path(args.folder), EvalOptions(text=Path(args.text), max_tokens=args.max_tokens, window=args.window))
    if args.json:
        print(json.dumps(result))
        return 0
    ppl = result["perplexity"]
    shown = {"qdq": "n/a (not quantized)", "program": "n/a (not lowered)"}
    shown.update({k: f"{v:.3f}" for k, v in ppl.items() if v is not None})
    print(f"{result['tokens']} tokens in windows of {result['window']}, recipe {result['recipe']}")
    print(f"perplexity  float {shown['float']}   qdq {shown['qdq']}   program {shown['program']}")
    print(f"{result['compared']} vs float: top-1 agreement {100 * result['top1_agreement']:.2f} %, "
          f"KL divergence {result['kl_divergence']:.5f}")
    if "prefill" in result:
        pre = result["prefill"]
        print(f"prefill vs float at {pre['positions']} chunk ends: top-1 agreement {100 * pre['top1_agreement']:.2f} %, "
              f"KL divergence {pre['kl_divergence']:.5f}")
    for layer, db in result.get("layer_sqnr_db", {}).items():
        print(f"  SQNR {layer:<10} {db:6.2f} dB")
    return 0


def _eval_images(args) -> int:
    from genai_pipeline.evaluate_images import evaluate_images

    r = evaluate_images(Path(args.folder), ImageEvalOptions(images=Path(args.images), limit=args.limit))
    if args.json:
        print(json.dumps(r))
        return 0
    match, ppl = r["exact_match"], r["answer_perplexity"]
    print(f"{r['questions']} image questions, recipe {r['recipe']}")
    print(f"exact match         float {100 * match['float']:.1f} %   program {100 * match['program']:.1f} %")
    print(f"answer perplexity   float {ppl['float']:.3f}   program {ppl['program']:.3f}   ({r['answer_tokens']} answer tokens)")
    print(f"the program's answer equals the float model's on {100 * r['answers_agree']:.1f} % of questions")
    return 0


def cmd_bench(args) -> int:
    from genai_pipeline.bench import bench
    from genai_pipeline.bundle import read_manifest
    from genai_pipeline.runtime.multimodal import is_multimodal

    options = BenchOptions(prompt_len=args.prompt_len, gen_len=args.gen_len, repeats=args.repeats, threads=args.threads,
                           lookahead=args.lookahead, prompt_file=Path(args.prompt_file) if args.prompt_file else None,
                           chat=args.chat)
    if is_multimodal(read_manifest(Path(args.folder))):
        return _bench_multimodal(args, options)
    r = bench(Path(args.folder), options)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{r['model']} {r['mode']} {r['recipe']}: load {r['load_s']:.2f} s, peak RSS {r['peak_rss_mb']:.0f} MB")
    print(f"prefill {r['prefill_tokens_per_s']:.1f} tok/s ({r['prompt_len']} tokens), decode {r['decode_tokens_per_s']:.1f} tok/s ({r['gen_len']} tokens)")
    print(f"decode reads {r['weight_bytes_per_token'] / 2**20:.1f} MB of weights per token: "
          f"{100 * r['bandwidth_share']:.1f} % of {r['memory_bandwidth_gbs']:.1f} GB/s copy bandwidth")
    if "lookahead" in r:
        a = r["lookahead"]
        print(f"lookahead {a['draft_len']}: decode {a['decode_tokens_per_s']:.1f} vs {a['plain_decode_tokens_per_s']:.1f} tok/s "
              f"plain ({a['speedup']:.2f}x), {a['tokens_per_call']:.2f} tokens per call, "
              f"{a['accepted']} of {a['drafted']} drafted tokens kept in {a['verify_calls']} verify calls ({a['tokens']} tokens); "
              f"a verify call takes as long as {a['verify_cost_in_steps']:.1f} decode steps")
    return 0


def _bench_multimodal(args, options) -> int:
    from genai_pipeline.bench_multimodal import bench_multimodal

    r = bench_multimodal(Path(args.folder), options)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{r['model']} {r['recipe']}: load {r['load_s']:.2f} s, peak RSS {r['peak_rss_mb']:.0f} MB")
    print(f"image encode {r['image_encode_ms']:.1f} ms ({r['image_size']} px, {r['image_tokens']} tokens); "
          f"time to first token {r['time_to_first_token_ms']:.1f} ms ({r['prompt_len']} prompt tokens, the image's included)")
    print(f"decode {r['decode_tokens_per_s']:.1f} tok/s ({r['gen_len']} tokens); medians of {r['repeats']} runs")
    return 0


def cmd_inspect(args) -> int:
    from genai_pipeline.inspect import format_report, inspect_program

    path = Path(args.file)
    if not path.is_dir():
        report = inspect_program(path)
        print(json.dumps(report, indent=2) if args.json else format_report(report))
        return 0
    # An export folder: each of its programs (a split vision-language export has three).
    from genai_pipeline.bundle import read_manifest
    from genai_pipeline.runtime.program import check_pte_file

    manifest = read_manifest(path)
    files = [a["file"] for a in manifest["artifacts"].values() if a.get("file")]
    for name in files:  # what is described is what was exported
        check_pte_file(path / name, *(manifest["files"].get(name, {}).get(k) for k in ("bytes", "sha256")))
    reports = {name: inspect_program(path / name) for name in files}
    print(json.dumps(reports, indent=2) if args.json else "\n\n".join(format_report(r) for r in reports.values()))
    return 0


class _HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless there is none to show (None, an empty
    list, a required option): the help text says what leaving it out means."""

    def _get_help_string(self, action):
        if action.default is None or action.default == [] or action.required:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    quant, calib, prepare = QuantOptions, CalibrationOptions, PrepareOptions
    sampling, bench, evaluate = SamplingOptions, BenchOptions, EvalOptions

    def subcommand(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=_HelpWithDefaults)

    parser = argparse.ArgumentParser(prog="genai", description="LLM checkpoints to verified ExecuTorch programs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = subcommand("models", "list the registry")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(func=cmd_models)

    p = subcommand("export", "prepare, compile and write .pte programs + manifest")
    p.add_argument("model", nargs="?", help="registry name (`genai models`); default: inferred from --checkpoint, "
                                            f"else {DEFAULT_MODEL}")
    p.add_argument("--checkpoint", help="local Hugging Face folder (config.json + *.safetensors), llama2.c folder (*.pt + tokenizer.model), "
                   "or llama.cpp GGUF file (or a folder holding one)")
    p.add_argument("--target", default="xnnpack", help="xnnpack, portable, or qnn (lowering needs the QNN SDK)")
    p.add_argument("--soc", default=_default(QnnOptions, "soc"),
                   help="qnn: the Snapdragon SoC, e.g. SM8650, SM8750, SM8550; its HTP arch and VTCM come from ExecuTorch's table")
    p.add_argument("--no-weight-sharing", action="store_true",
                   help="qnn: one context binary per method instead of one shared by prefill and decode (HTP older than V73)")
    p.add_argument("--qnn-x86-emulator", action="store_true", help="qnn: for the HTP emulator on x86 (no weight sharing, no shared buffers)")
    p.add_argument("--qnn-option", action="append", default=[], metavar="[METHOD:]KEY=VALUE",
                   help="qnn: an HTP option of the compile spec (repeatable), e.g. precision=fp16, performance_mode=burst, "
                        "use_multi_contexts=true, max_sf_buf_size=BYTES (spill-fill); METHOD: only with --no-weight-sharing")
    p.add_argument("--recipe", default=_default(quant, "recipe"),
                   help="xnnpack: fp32, 8da4w, 8da8w, 8a8w; qnn: 16a8w, 16a4w, 16a4w_block, 8a8w")
    p.add_argument("--group-size", type=int, default=_default(quant, "group_size"), help="int4 group size")
    p.add_argument("--embedding", default=_default(quant, "embedding"), help="token embedding: auto (8da4w: 4w, 8da8w: 8w, else fp32), fp32, 8w or 4w")
    p.add_argument("--vision-recipe", choices=("fp32", "8da8w", "8da4w"),
                   help="a vision-language model's image tower and connector (their linear layers; patch and position "
                        "embeddings stay float); default: 8da8w under --recipe 8da4w, else --recipe's")
    p.add_argument("--quant-override", action="append", default=[], metavar="REGEX=RECIPE",
                   help="recipe for linear layers whose name matches REGEX (first match wins), e.g. output=8da8w")
    p.add_argument("--size-budget", type=float, metavar="MB",
                   help="8da4w: the program's size in MB (10^6 bytes); which block linears keep 8 bits is then chosen by their "
                        "measured gain per byte on the calibration text, instead of by the fixed rules")
    p.add_argument("--block-size", type=int, default=_default(quant, "block_size"), help="16a4w_block block size")
    p.add_argument("--calib", action="append", default=[], metavar="NAME:ARG",
                   help="calibration data for static recipes (repeatable): random, text:FILE, messages:FILE.json, "
                        "hf-chat:DIR, lm-eval:FILE; none given: random")
    p.add_argument("--calib-limit", type=int, default=_default(calib, "limit"), help="samples in all; default: every sample (random: 8)")
    p.add_argument("--calib-seq-len", type=int, default=_default(calib, "seq_len"), help="tokens per sample")
    p.add_argument("--mode", default=_default(prepare, "mode").value, choices=[m.value for m in names.Mode],
                   help="hybrid: prefill + decode methods; kv: decode only; dynamic: one forward of any length")
    p.add_argument("--max-seq-len", type=int, default=_default(prepare, "max_seq_len"), help="KV cache length: prompt + generated tokens")
    p.add_argument("--prefill-len", type=int, default=_default(prepare, "prefill_len"), help="tokens per prefill call (hybrid mode)")
    p.add_argument("--long-prefill-len", type=int, metavar="N",
                   help=f"hybrid: add a `prefill_long` method of 1 to N tokens, which prompts then go through in chunks of up to N (0: none; "
                        f"default: {LONG_PREFILL_CHUNKS} x --prefill-len where the cache holds it)")
    p.add_argument("--verify-len", type=int, default=_default(prepare, "verify_len"),
                   help="add a `verify` method of N tokens returning every token's logits, for `genai run --lookahead` (0: none)")
    p.add_argument("--cache-io", action="store_true",
                   help="the decoder's cache-I/O form (always for --target qnn): KV cache, positions and attention mask as "
                        "method inputs/outputs, static shapes, no custom ops; the runtime owns the cache")
    p.add_argument("--seed", type=int, default=_default(prepare, "seed"), help="seed for random weights")
    p.add_argument("--split", action="store_true",
                   help="vision-language models: one program per component (vision_encoder.pte, token_embedding.pte, "
                        "text_decoder.pte with --mode's methods) instead of one program with three methods")
    p.add_argument("--out", required=True, help="output folder: built beside it, then swapped in when complete")
    p.set_defaults(func=cmd_export)

    p = subcommand("run", "generate text with an exported folder")
    p.add_argument("folder", help="a folder written by `genai export`")
    p.add_argument("--prompt", help="the text to continue; with --chat, the first user message")
    p.add_argument("--chat", action="store_true",
                   help="a conversation through the folder's chat template: user messages from stdin, "
                        "/image PATH attaches an image to the next message (vision-language models; --image: to the first), "
                        "/reset clears it, /exit or end of input quits")
    p.add_argument("--system", help="with --chat: the system message")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=_default(sampling, "temperature"), help="0: greedy")
    p.add_argument("--top-k", type=int, default=_default(sampling, "top_k"), help="sample among the K likeliest tokens; 0: off")
    p.add_argument("--top-p", type=float, default=_default(sampling, "top_p"), help="sample within probability mass P; 1: off")
    p.add_argument("--seed", type=int, default=_default(sampling, "seed"), help="sampling seed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the program against its manifest")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for a vision-language model (repeatable): each <image> in the prompt takes the next; none: images first")
    p.add_argument("--max-tiles", type=int, default=0, help="cap on the tiles an image is split into (0: the processor's own limit)")
    p.add_argument("--lookahead", type=int, default=0, metavar="N",
                   help="draft up to N tokens from the context and check them in one call (lossless; needs a program "
                        "exported with --verify-len; 0: off)")
    p.set_defaults(func=cmd_run)

    p = subcommand("eval", "a program against its float model: perplexity, top-1 agreement and KL on text, "
                           "or exact match and answer perplexity on image questions")
    p.add_argument("folder", help="a folder written by `genai export`")
    p.add_argument("--text", help="UTF-8 text to score (a vision-language program: its text path)")
    p.add_argument("--images", metavar="FILE.jsonl",
                   help='image questions, one {"image", "prompt", "answer"} a line (image paths relative to the file), '
                        "for a vision-language program")
    p.add_argument("--limit", type=int, default=0, help="--images: the first N questions (0: all)")
    p.add_argument("--max-tokens", type=int, default=_default(evaluate, "max_tokens"), help="tokens of the text to score")
    p.add_argument("--window", type=int, default=_default(evaluate, "window"), help="tokens per window (the cache starts empty in each); 0: the program's context")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_eval)

    p = subcommand("bench", "load time, prefill and decode speed, peak RSS, bandwidth share; a vision-language program: "
                            "image encode time, time to first token with one image, decode speed, peak RSS")
    p.add_argument("folder", help="a folder written by `genai export`")
    p.add_argument("--prompt-len", type=int, default=_default(bench, "prompt_len"), help="prompt tokens to prefill (a vision-language program: text tokens after the image)")
    p.add_argument("--gen-len", type=int, default=_default(bench, "gen_len"), help="tokens to decode")
    p.add_argument("--repeats", type=int, default=_default(bench, "repeats"), help="timed runs after a warm-up; medians are reported")
    p.add_argument("--threads", type=int, default=_default(bench, "threads"), help="runtime threads; 0: one per core")
    p.add_argument("--lookahead", type=int, default=_default(bench, "lookahead"), metavar="N",
                   help="also time lookahead decoding (drafts of up to N tokens) against plain decoding, alternating; 0: off")
    p.add_argument("--prompt-file", help="the prompt's text instead of --prompt-len random ids")
    p.add_argument("--chat", action="store_true", help="--prompt-file is a user message, through the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_bench)

    p = subcommand("inspect", "methods, delegates, shared data and metadata of a .pte")
    p.add_argument("file", help="a .pte program, or an export folder: each of its programs")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_inspect)
    return parser


def _default(options: type, name: str):
    """The default of field `name` of an option class (options.py): every default is written once, there."""
    return next(f.default for f in dataclasses.fields(options) if f.name == name)


def _one_openmp_thread_per_caller(argv: list[str]) -> None:
    """For the commands that time programs: ExecuTorch's custom SDPA kernel calls MKL from inside
    ExecuTorch's own thread pool, and by default each such call starts an OpenMP team whose
    spinning threads take the cores from XNNPACK's GEMMs (docs/decisions/0002). OpenMP reads this
    once, when torch loads it, so it is set before the parser imports torch; `export` and `eval`
    keep torch's intra-op threads for their eager work."""
    if argv[:1] in (["run"], ["bench"]):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _one_openmp_thread_per_caller(argv)
    _quiet_libraries()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("genai: %(message)s"))
    log.handlers = [handler]
    log.setLevel(logging.DEBUG if os.environ.get("GENAI_DEBUG") else logging.INFO)
    log.propagate = False
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except GenAIError as e:
        if os.environ.get("GENAI_DEBUG") and e.__cause__ is not None:  # e.g. the lowering failure it wraps
            traceback.print_exception(e.__cause__)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `genai inspect ... | head`: the reader has gone, nothing is wrong here
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit flush stays quiet
        return 0
    except Exception as e:  # a bug: still one line for the user, the traceback on request
        if os.environ.get("GENAI_DEBUG"):
            raise
        print(f"internal error: {type(e).__name__}: {e} (set GENAI_DEBUG=1 for the traceback)", file=sys.stderr)
        return 3
    finally:
        log.handlers = []  # the handler holds this call's stderr
        log.propagate = True  # a caller in the same process (a test's caplog) sees the package's records again


if __name__ == "__main__":
    sys.exit(main())
