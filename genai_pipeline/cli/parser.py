"""The `genai` command line: its subcommands and flags, every default read from the option
dataclasses of options.py (which import no torch: `genai --help` answers at once)."""

from __future__ import annotations

import argparse
import dataclasses

from genai_pipeline import names
from genai_pipeline.options import (
    DEFAULT_MODEL,
    LONG_PREFILL_CHUNKS,
    BenchOptions,
    CalibrationOptions,
    EvalOptions,
    PrepareOptions,
    QnnOptions,
    QuantOptions,
    SamplingOptions,
)
from genai_pipeline.sweep.spec import SPEC_EXAMPLE


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, unless there is none to show (None, an empty
    list, a required option): the help text says what leaving it out means."""

    def _get_help_string(self, action):
        if action.default is None or action.default == [] or action.required:
            return action.help
        return super()._get_help_string(action)


class HelpWithExample(HelpWithDefaults, argparse.RawDescriptionHelpFormatter):
    """HelpWithDefaults, with the description and epilog (an example) shown as written."""


def build_parser() -> argparse.ArgumentParser:
    quant, calib, prepare = QuantOptions, CalibrationOptions, PrepareOptions
    sampling, bench, evaluate = SamplingOptions, BenchOptions, EvalOptions

    def subcommand(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=HelpWithDefaults)

    parser = argparse.ArgumentParser(prog="genai", description="LLM checkpoints to verified ExecuTorch programs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = subcommand("models", "list the registry")
    p.add_argument("--json", action="store_true", help="print the list as JSON")

    p = subcommand("export", "prepare, compile and write .pte programs + manifest")
    p.add_argument(
        "model",
        nargs="?",
        help=f"registry name (`genai models`); default: inferred from --checkpoint, else {DEFAULT_MODEL}",
    )
    p.add_argument(
        "--checkpoint",
        help="local Hugging Face folder (config.json + *.safetensors), llama2.c folder (*.pt + tokenizer.model), "
        "or llama.cpp GGUF file (or a folder holding one)",
    )
    p.add_argument("--target", default="xnnpack", help="xnnpack, portable, or qnn (lowering needs the QNN SDK)")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="each stage's wall and CPU time and peak memory as it ends (also in the manifest's export_stages)",
    )
    p.add_argument(
        "--soc",
        default=default(QnnOptions, "soc"),
        help="qnn: the Snapdragon SoC, e.g. SM8650, SM8750, SM8550; its HTP arch and VTCM come from ExecuTorch's table",
    )
    p.add_argument(
        "--no-weight-sharing",
        action="store_true",
        help="qnn: one context binary per method instead of one shared by prefill and decode (HTP older than V73)",
    )
    p.add_argument(
        "--qnn-x86-emulator",
        action="store_true",
        help="qnn: for the HTP emulator on x86 (no weight sharing, no shared buffers)",
    )
    p.add_argument(
        "--qnn-option",
        action="append",
        default=[],
        metavar="[METHOD:]KEY=VALUE",
        help="qnn: an HTP option of the compile spec (repeatable), e.g. precision=fp16, performance_mode=burst, "
        "use_multi_contexts=true, max_sf_buf_size=BYTES (spill-fill); METHOD: only with --no-weight-sharing",
    )
    p.add_argument(
        "--recipe",
        default=default(quant, "recipe"),
        help="xnnpack: fp32, 8da4w, 8da8w, 8a8w; qnn: 16a8w, 16a4w, 16a4w_block, 8a8w",
    )
    p.add_argument("--group-size", type=int, default=default(quant, "group_size"), help="int4 group size")
    p.add_argument(
        "--embedding",
        default=default(quant, "embedding"),
        help="token embedding: auto (8da4w: 4w, 8da8w: 8w, else fp32), fp32, 8w or 4w",
    )
    p.add_argument(
        "--vision-recipe",
        choices=("fp32", "8da8w", "8da4w"),
        help="a vision-language model's image tower and connector (their linear layers; patch and position "
        "embeddings stay float); default: 8da8w under --recipe 8da4w, else --recipe's",
    )
    p.add_argument(
        "--quant-override",
        action="append",
        default=[],
        metavar="REGEX=RECIPE",
        help="recipe for linear layers whose name matches REGEX (first match wins), e.g. output=8da8w",
    )
    p.add_argument(
        "--size-budget",
        type=float,
        metavar="MB",
        help="8da4w: the program's size in MB (10^6 bytes); which block linears keep 8 bits, and how many of a tied "
        "4-bit table's first rows, is then chosen by their measured gain per byte on the calibration text, instead of by "
        "the fixed rules",
    )
    p.add_argument(
        "--table-8bit-rows",
        type=int,
        metavar="N",
        help="8da4w with a tied token table at 4 bits: its first N rows (the lowest ids, a vocabulary's most "
        "frequent tokens) at 8 bits, for lookup and LM head alike; default: as many as add at most 4 %% to the bytes a "
        "decode step reads (SmolLM2-135M: 13312); 0: none",
    )
    p.add_argument("--block-size", type=int, default=default(quant, "block_size"), help="16a4w_block block size")
    p.add_argument(
        "--no-calibration",
        action="store_true",
        help="dynamic recipes without calibration text: 4-bit weights by least squares (mse) instead of GPTQ, no "
        "SmoothQuant, the same 8-bit layers; for a checkpoint without a tokenizer (random weights get it by themselves)",
    )
    p.add_argument(
        "--calib",
        action="append",
        default=[],
        metavar="NAME:ARG",
        help="calibration data for static recipes (repeatable): random, text:FILE, messages:FILE.json, "
        "hf-chat:DIR, lm-eval:FILE; none given: random",
    )
    p.add_argument(
        "--calib-limit",
        type=int,
        default=default(calib, "limit"),
        help="samples in all; default: every sample (random: 8)",
    )
    p.add_argument("--calib-seq-len", type=int, default=default(calib, "seq_len"), help="tokens per sample")
    p.add_argument(
        "--mode",
        default=default(prepare, "mode").value,
        choices=[m.value for m in names.Mode],
        help="hybrid: prefill (any length) + decode, and prefill_chunk (static); kv: decode only; dynamic: one forward of any length",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=default(prepare, "max_seq_len"),
        help="KV cache length: prompt + generated tokens",
    )
    p.add_argument(
        "--prefill-len",
        type=int,
        default=default(prepare, "prefill_len"),
        help="tokens per prefill_chunk call (hybrid mode)",
    )
    p.add_argument(
        "--long-prefill-len",
        type=int,
        metavar="N",
        help=f"hybrid: the `prefill` method takes 1 to N tokens, and prompts go through it in chunks of up to N (0: no `prefill`; "
        f"default: {LONG_PREFILL_CHUNKS} x --prefill-len where the cache holds it)",
    )
    p.add_argument(
        "--verify-len",
        type=int,
        default=default(prepare, "verify_len"),
        help="add a `verify` method of N tokens returning every token's logits, for `genai run --lookahead` (0: none)",
    )
    p.add_argument(
        "--cache-io",
        action="store_true",
        help="the decoder's cache-I/O form (always for --target qnn): KV cache, positions and attention mask as "
        "method inputs/outputs, static shapes, no custom ops; the runtime owns the cache",
    )
    p.add_argument("--seed", type=int, default=default(prepare, "seed"), help="seed for random weights")
    p.add_argument(
        "--split",
        action="store_true",
        help="vision-language models: one program per component (vision_encoder.pte, token_embedding.pte, "
        "text_decoder.pte with --mode's methods) instead of one program with three methods",
    )
    p.add_argument("--out", required=True, help="output folder: built beside it, then swapped in when complete")

    p = subcommand("run", "generate text with an exported folder")
    p.add_argument("folder", help="a folder written by `genai export`")
    p.add_argument("--prompt", help="the text to continue; with --chat, the first user message")
    p.add_argument(
        "--chat",
        action="store_true",
        help="a conversation through the folder's chat template: user messages from stdin, "
        "/image PATH attaches an image to the next message (vision-language models; --image: to the first), "
        "/audio PATH a WAV or FLAC file (speech models; --audio: to the first), /reset clears it, /exit or end of input quits",
    )
    p.add_argument("--system", help="with --chat: the system message")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=default(sampling, "temperature"), help="0: greedy")
    p.add_argument(
        "--top-k", type=int, default=default(sampling, "top_k"), help="sample among the K likeliest tokens; 0: off"
    )
    p.add_argument(
        "--top-p", type=float, default=default(sampling, "top_p"), help="sample within probability mass P; 1: off"
    )
    p.add_argument("--seed", type=int, default=default(sampling, "seed"), help="sampling seed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the program against its manifest")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image for a vision-language model (repeatable): each <image> in the prompt takes the next; none: images first",
    )
    p.add_argument(
        "--audio",
        action="append",
        default=[],
        metavar="PATH",
        help="a WAV or FLAC file for a speech model (repeatable): each <audio> in the prompt takes the next; none: audio first",
    )
    p.add_argument(
        "--max-tiles",
        type=int,
        default=0,
        help="cap on the tiles an image is split into (0: the processor's own limit)",
    )
    p.add_argument(
        "--lookahead",
        type=int,
        default=0,
        metavar="N",
        help="draft up to N tokens from the context and check them in one call (lossless; needs a program "
        "exported with --verify-len; 0: off)",
    )

    p = subcommand(
        "eval",
        "a program against its float model: perplexity, top-1 agreement and KL on text, "
        "or exact match and answer perplexity on image questions",
    )
    p.add_argument("folder", help="a folder written by `genai export`")
    p.add_argument("--text", help="UTF-8 text to score (a vision-language program: its text path)")
    p.add_argument(
        "--images",
        metavar="FILE.jsonl",
        help='image questions, one {"image", "prompt", "answer"} a line (image paths relative to the file), '
        "for a vision-language program",
    )
    p.add_argument("--limit", type=int, default=0, help="--images: the first N questions (0: all)")
    p.add_argument(
        "--max-tokens", type=int, default=default(evaluate, "max_tokens"), help="tokens of the text to score"
    )
    p.add_argument(
        "--window",
        type=int,
        default=default(evaluate, "window"),
        help="tokens per window (the cache starts empty in each); 0: the program's context",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = subcommand(
        "bench",
        "load time, prefill and decode speed, peak RSS, bandwidth share; a vision-language program: "
        "image encode time, time to first token with one image, decode speed, peak RSS",
    )
    p.add_argument("folder", help="a folder written by `genai export`")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=default(bench, "prompt_len"),
        help="prompt tokens to prefill (a vision-language program: text tokens after the image)",
    )
    p.add_argument("--gen-len", type=int, default=default(bench, "gen_len"), help="tokens to decode")
    p.add_argument(
        "--repeats",
        type=int,
        default=default(bench, "repeats"),
        help="timed runs after a warm-up; medians are reported",
    )
    p.add_argument("--threads", type=int, default=default(bench, "threads"), help="runtime threads; 0: one per core")
    p.add_argument(
        "--lookahead",
        type=int,
        default=default(bench, "lookahead"),
        metavar="N",
        help="also time lookahead decoding (drafts of up to N tokens) against plain decoding, alternating; 0: off",
    )
    p.add_argument("--prompt-file", help="the prompt's text instead of --prompt-len random ids")
    p.add_argument("--chat", action="store_true", help="--prompt-file is a user message, through the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = subcommand(
        "serve",
        "an OpenAI-compatible HTTP server over an export folder: /v1/chat/completions, /v1/completions, "
        "/v1/models, /health",
    )
    p.add_argument("folder", help="a folder written by `genai export`")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on; the default is this machine only (0.0.0.0: every interface, no authentication)",
    )
    p.add_argument("--port", type=int, default=8000, help="the port to listen on (0: any free one, printed at start)")
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="sessions that generate at once, each with its own KV cache (the weights are packed once); "
        "more requests wait in a queue",
    )
    p.add_argument(
        "--lookahead",
        type=int,
        default=0,
        metavar="N",
        help="lookahead decoding with drafts of up to N tokens (needs a program exported with --verify-len; 0: off)",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the program against its manifest")

    p = sub.add_parser(
        "sweep",
        help="export, verify, evaluate and benchmark every (model, variant) of a YAML spec as tasks on Ray",
        description="Export, verify, evaluate (genai eval --text; a vision-language model: --images on eval.images) "
        "and benchmark (genai bench) every (model, variant) of SPEC.yaml as tasks on Ray,\nthen write DIR/sweep.json (a row per task) and DIR/report.html (the Pareto "
        "chart, the table, a recommendation per size class).\nA re-run skips finished tasks and retries failed ones. "
        "The spec is YAML (docs/sweep.md), for example:",
        epilog=SPEC_EXAMPLE,
        formatter_class=HelpWithExample,
    )
    p.add_argument("spec", metavar="SPEC.yaml", help="models, variants, export, eval, bench and report sections")
    p.add_argument("--out", required=True, metavar="DIR", help="where sweep.json, report.html and the tasks' rows go")
    p.add_argument(
        "--storage",
        metavar="PATH",
        help="where the export folders go, a folder every node sees (a shared filesystem on a cluster); "
        "default: DIR/exports",
    )
    p.add_argument(
        "--address",
        help="an existing Ray cluster to join (`ray start --head` prints it; auto: the one on this machine); "
        "default: a local Ray on this machine",
    )

    p = subcommand("inspect", "methods, delegates, shared data and metadata of a .pte")
    p.add_argument("file", help="a .pte program, or an export folder: each of its programs")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def default(options: type, name: str):
    """The default of field `name` of an option class (options.py): every default is written once, there."""
    return next(f.default for f in dataclasses.fields(options) if f.name == name)
