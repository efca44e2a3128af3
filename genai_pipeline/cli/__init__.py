"""`genai models | export | run | eval | bench | inspect | serve | sweep`. Options and their defaults come from the
dataclasses of options.py, which import no torch: `genai --help` answers at once."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path

from genai_pipeline.cli.parser import build_parser, default
from genai_pipeline.cli.run import cmd_run
from genai_pipeline.cli.serve import cmd_serve
from genai_pipeline.cli.sweep import cmd_sweep
from genai_pipeline.errors import GenAIError, InputError
from genai_pipeline.options import (
    DEFAULT_MODEL,
    BenchOptions,
    CalibrationOptions,
    EvalOptions,
    ImageEvalOptions,
    PrepareOptions,
    QnnOptions,
    QuantOptions,
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
            # a VLM's image tower, a speech model's audio tower too
            "params": s.config.num_params + sum(t.config.num_params for t in (s.vision, s.audio) if t is not None),
            "weights": "shipped" if s.checkpoint else "--checkpoint DIR",
            "default": s.name == DEFAULT_MODEL,
            "description": s.description,
        }
        for s in SPECS.values()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    family_width = max(len(r["family"]) for r in rows)
    for r in rows:
        params = f"{r['params'] / 1e6:.1f}M" if r["params"] < 1e9 else f"{r['params'] / 1e9:.2f}B"
        mark = " (default)" if r["default"] else ""
        print(
            f"{r['name']:<16} {r['family']:<{family_width}} {params:>8}  weights: {r['weights']:<17} {r['description']}{mark}"
        )
    return 0


def cmd_export(args) -> int:
    from genai_pipeline.export import export
    from genai_pipeline.targets import get_target

    target = qnn_configured(get_target(args.target), args)  # QNN options checked before any work
    if args.verbose:
        log.setLevel(logging.DEBUG)
    quant = QuantOptions(
        recipe=args.recipe,
        group_size=args.group_size,
        embedding=args.embedding,
        overrides=tuple(parse_override(o) for o in args.quant_override),
        block_size=args.block_size,
        calibration=CalibrationOptions(datasets=tuple(args.calib), limit=args.calib_limit, seq_len=args.calib_seq_len),
        vision_recipe=args.vision_recipe,
        size_budget=args.size_budget,
        table_8bit_rows=args.table_8bit_rows,
    )
    if args.no_calibration:
        from genai_pipeline.quantize.calibration import calibration_free

        quant = calibration_free(quant)
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
    log.info("wrote %s in %.1f s", result.folder, result.manifest.export_seconds)
    for name, f in result.manifest.files.items():
        log.info("  %s  %.2f MiB", name, f.bytes / (1 << 20))
    return 0


def _terminated(signum, frame):
    raise KeyboardInterrupt


def qnn_configured(target, args):
    """The target with the QNN options applied; a QNN option given for another target is refused."""
    from genai_pipeline.names import Mode
    from genai_pipeline.targets import qnn

    given = [
        flag
        for flag, on in (
            ("--soc", args.soc != default(QnnOptions, "soc")),
            ("--qnn-option", args.qnn_option),
            ("--no-weight-sharing", args.no_weight_sharing),
            ("--qnn-x86-emulator", args.qnn_x86_emulator),
        )
        if on
    ]
    if target.name != qnn.TARGET.name:
        if given:
            raise InputError(f"{given[0]} applies to --target qnn only (the target is {target.name})")
        return target
    options = QnnOptions(
        soc=args.soc,
        weight_sharing=not args.no_weight_sharing,
        x86_emulator=args.qnn_x86_emulator,
        options=tuple(args.qnn_option),
    )
    return qnn.configure(options, [g.value for g in Mode(args.mode).graphs])


def cmd_eval(args) -> int:
    from genai_pipeline.evaluate import evaluate

    if (args.text is None) == (args.images is None):
        raise InputError(
            "pass --text FILE (perplexity, top-1 agreement, KL) or --images FILE.jsonl (image questions), one of them"
        )
    if args.images is not None:
        return _eval_images(args)
    if args.limit:
        raise InputError("--limit goes with --images (with --text, --max-tokens bounds the work)")
    result = evaluate(
        Path(args.folder), EvalOptions(text=Path(args.text), max_tokens=args.max_tokens, window=args.window)
    )
    if args.json:
        print(json.dumps(result))
        return 0
    ppl = result["perplexity"]
    shown = {"qdq": "n/a (not quantized)", "program": "n/a (not lowered)"}
    shown.update({k: f"{v:.3f}" for k, v in ppl.items() if v is not None})
    print(f"{result['tokens']} tokens in windows of {result['window']}, recipe {result['recipe']}")
    print(f"perplexity  float {shown['float']}   qdq {shown['qdq']}   program {shown['program']}")
    print(
        f"{result['compared']} vs float: top-1 agreement {100 * result['top1_agreement']:.2f} %, "
        f"KL divergence {result['kl_divergence']:.5f}"
    )
    if "prefill" in result:
        pre = result["prefill"]
        print(
            f"prefill vs float at {pre['positions']} chunk ends: top-1 agreement {100 * pre['top1_agreement']:.2f} %, "
            f"KL divergence {pre['kl_divergence']:.5f}"
        )
    for layer, db in result.get("layer_sqnr_db", {}).items():
        print(f"  SQNR {layer:<10} {db:6.2f} dB")
    return 0


def _eval_images(args) -> int:
    from genai_pipeline.evaluate import evaluate_images

    r = evaluate_images(Path(args.folder), ImageEvalOptions(images=Path(args.images), limit=args.limit))
    if args.json:
        print(json.dumps(r))
        return 0
    match, ppl = r["exact_match"], r["answer_perplexity"]
    print(f"{r['questions']} image questions, recipe {r['recipe']}")
    print(f"exact match         float {100 * match['float']:.1f} %   program {100 * match['program']:.1f} %")
    print(
        f"answer perplexity   float {ppl['float']:.3f}   program {ppl['program']:.3f}   ({r['answer_tokens']} answer tokens)"
    )
    print(f"the program's answer equals the float model's on {100 * r['answers_agree']:.1f} % of questions")
    return 0


def cmd_bench(args) -> int:
    from genai_pipeline.bench import bench
    from genai_pipeline.manifest import Manifest
    from genai_pipeline.runtime.multimodal import is_multimodal

    options = BenchOptions(
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        repeats=args.repeats,
        threads=args.threads,
        lookahead=args.lookahead,
        prompt_file=Path(args.prompt_file) if args.prompt_file else None,
        chat=args.chat,
    )
    if is_multimodal(Manifest.read(Path(args.folder))):
        return _bench_multimodal(args, options)
    r = bench(Path(args.folder), options)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{r['model']} {r['mode']} {r['recipe']}: load {r['load_s']:.2f} s, peak RSS {r['peak_rss_mb']:.0f} MB")
    print(
        f"prefill {r['prefill_tokens_per_s']:.1f} tok/s ({r['prompt_len']} tokens), decode {r['decode_tokens_per_s']:.1f} tok/s ({r['gen_len']} tokens)"
    )
    print(
        f"decode reads {r['weight_bytes_per_token'] / 2**20:.1f} MB of weights per token: "
        f"{100 * r['bandwidth_share']:.1f} % of {r['memory_bandwidth_gbs']:.1f} GB/s copy bandwidth"
    )
    if "lookahead" in r:
        a = r["lookahead"]
        print(
            f"lookahead {a['draft_len']}: decode {a['decode_tokens_per_s']:.1f} vs {a['plain_decode_tokens_per_s']:.1f} tok/s "
            f"plain ({a['speedup']:.2f}x), {a['tokens_per_call']:.2f} tokens per call, "
            f"{a['accepted']} of {a['drafted']} drafted tokens kept in {a['verify_calls']} verify calls ({a['tokens']} tokens); "
            f"a verify call takes as long as {a['verify_cost_in_steps']:.1f} decode steps"
        )
    return 0


def _bench_multimodal(args, options) -> int:
    from genai_pipeline.bench import bench_multimodal

    r = bench_multimodal(Path(args.folder), options)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"{r['model']} {r['recipe']}: load {r['load_s']:.2f} s, peak RSS {r['peak_rss_mb']:.0f} MB")
    print(
        f"image encode {r['image_encode_ms']:.1f} ms ({r['image_size']} px, {r['image_tokens']} tokens); "
        f"time to first token {r['time_to_first_token_ms']:.1f} ms ({r['prompt_len']} prompt tokens, the image's included)"
    )
    print(
        f"prefill {r['prefill_tokens_per_s']:.1f} tok/s (the first token's time less the encode), "
        f"decode {r['decode_tokens_per_s']:.1f} tok/s ({r['gen_len']} tokens); medians of {r['repeats']} runs"
    )
    return 0


def cmd_inspect(args) -> int:
    from genai_pipeline.inspect import format_report, inspect_program

    path = Path(args.file)
    if not path.is_dir():
        report = inspect_program(path)
        print(json.dumps(report, indent=2) if args.json else format_report(report))
        return 0
    # An export folder: each of its programs (a split vision-language export has three).
    from genai_pipeline.manifest import Manifest
    from genai_pipeline.runtime.program import check_pte_file

    manifest = Manifest.read(path)
    files = list(manifest.programs.values())
    for name in files:  # what is described is what was exported
        check_pte_file(path / name, manifest.files[name].bytes, manifest.files[name].sha256)
    reports = {name: inspect_program(path / name) for name in files}
    print(json.dumps(reports, indent=2) if args.json else "\n\n".join(format_report(r) for r in reports.values()))
    return 0


def one_openmp_thread_per_caller(argv: list[str]) -> None:
    """For the commands that time programs: ExecuTorch's custom SDPA kernel calls MKL from inside
    ExecuTorch's own thread pool, and by default each such call starts an OpenMP team whose
    spinning threads take the cores from XNNPACK's GEMMs (docs/decisions/0002). OpenMP reads this
    once, when torch loads it, so it is set before the parser imports torch; `export` and `eval`
    keep torch's intra-op threads for their eager work."""
    if argv[:1] in (["run"], ["bench"], ["serve"]):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    one_openmp_thread_per_caller(argv)
    _quiet_libraries()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("genai: %(message)s"))
    log.handlers = [handler]
    log.setLevel(logging.DEBUG if os.environ.get("GENAI_DEBUG") else logging.INFO)
    log.propagate = False
    args = build_parser().parse_args(argv)
    try:
        commands = {
            "models": cmd_models,
            "export": cmd_export,
            "run": cmd_run,
            "eval": cmd_eval,
            "bench": cmd_bench,
            "inspect": cmd_inspect,
            "serve": cmd_serve,
            "sweep": cmd_sweep,
        }
        return commands[args.command](args)
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
