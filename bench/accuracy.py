"""Accuracy of our quantization recipes on a real model, as programs, beside llama.cpp's.

For each variant (a QuantOptions of ours): export the program in a child process (the Python API,
genai_pipeline.export, so that options the CLI does not expose, e.g. today's torchao weight rule,
can be measured), score the PROGRAM with `genai eval` on the same token ids
(perplexity, top-1 agreement and KL divergence against the float model), its file size, and
decode / prefill speed with `genai bench` (round-robin over the variants, medians). Writes JSON
and a perplexity-vs-size chart (PNG) under bench/results and prints a table.

    .venv/bin/python -m bench.accuracy --checkpoint /tmp/smollm2-fp32 \\
        --text assets/reference/heldout.txt [--variants 8da4w 8da4w-today 8da8w] [--repeats 3]
    .venv/bin/python -m bench.accuracy --checkpoint /tmp/smollm2-fp32 --levers [LEVER ...]   # eager study
    .venv/bin/python -m bench.accuracy --checkpoint .cache/gemma-3-270m-q4_k_m.gguf --qdq \
        --variants 8da4w 8da4w-table8 8da8w    # the quantize stage itself, QDQ models on 4096 tokens of both texts
        [--llamacpp --repeats 0]               # and llama.cpp's types of the same float weights on the same ids

llama.cpp rows: with `--llamacpp`, measured here on the same token ids. llama-cpp-python, built
from its sdist into bench/.envs/llamacpp by bench/compare.py (its `done.json` says it is there;
this script does not build it), converts the same fp32 folder with the sdist's
convert_hf_to_gguf.py and quantizes it with llama_model_quantize (bench/peers.py's workers), then
scores every GGUF on the ids `genai eval` scores (all logits of each window, the F32 file's the
reference for KL and top-1); the two fp32 perplexities must agree. A GGUF checkpoint's F32 file is
its own tensors dequantized by llama_model_quantize (the float weights genai reads from it).
Without `--llamacpp` the rows are the figures of the issue (SmolLM2-135M-Instruct, same 1022 tokens
of heldout.txt, windows of 512), marked `reference: true`. Sizes are MiB (2^20 bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

from bench import png_chart
from bench.harness import ENVS, HERE, ROOT, main_or_worker, run_child
from bench.peers import export_llamacpp, install_llamacpp

# name -> QuantOptions keyword arguments
W2_4BIT = [["feed_forward\\.w2$", "8da4w"]]  # every w2 at 4 bits (the default keeps some at 8: more_bits_layer)
W2_8BIT = [["feed_forward\\.w2$", "8da8w"]]  # every w2 at 8 bits (the default before the mix)
VARIANTS = {
    # the default: rotated, smoothed, gptq (head too), wv 8-bit, w2 8-bit in llama.cpp's more-bits layers
    # and w1/w3 in the edge layers, embedding 4w; where the tied table holds half the weights, every
    # block linear 8-bit and no run-time rotation instead (docs/decisions/0047)
    "8da4w": {"recipe": "8da4w"},
    # the fixed 8-bit rules even where the tied table holds half the weights (the default before
    # docs/decisions/0047; on other models the same as 8da4w)
    "8da4w-4bit-blocks": {"recipe": "8da4w", "keep_8bit": ["\\.attention\\.wv$"]},
    "8da4w-norot": {"recipe": "8da4w", "rotate": False},  # the default, not rotated
    "8da4w-nosq": {"recipe": "8da4w", "smooth": None, "rotate": False},  # the default, neither smoothed nor rotated
    "8da4w-head8": {"recipe": "8da4w", "head": "8da8w", "overrides": W2_4BIT},  # gptq, head and wv 8-bit
    "8da4w-mse": {
        "recipe": "8da4w",
        "weight_rule": "mse",
        "keep_8bit": [],
        "overrides": W2_4BIT,
    },  # no calibration: mse scales, head 8da8w
    "8da4w-nowv8": {"recipe": "8da4w", "keep_8bit": [], "overrides": W2_4BIT},  # gptq, 4-bit but the edge layers' w1/w3
    "8da4w-today": {
        "recipe": "8da4w",
        "weight_rule": "torchao",
        "head": "8da4w",
        "keep_8bit": [],
        "overrides": W2_4BIT,
        "smooth": None,
        "rotate": False,
    },  # the default when the accuracy issue was filed (but the edge layers)
    "8da4w-head4": {"recipe": "8da4w", "overrides": W2_4BIT},  # every w2 4-bit: the smallest
    "8da4w-head4-norot": {"recipe": "8da4w", "overrides": W2_4BIT, "rotate": False},
    "8da4w-w2all8": {"recipe": "8da4w", "overrides": W2_8BIT},  # every w2 8-bit: the default before the mix
    "8da4w-wv4": {"recipe": "8da4w", "keep_8bit": [], "overrides": W2_8BIT},  # wv at 4 bits (docs/decisions/0017)
    "8da4w-mse-head4": {
        "recipe": "8da4w",
        "weight_rule": "mse",
        "head": "8da4w",
        "keep_8bit": [],
        "overrides": W2_4BIT,
    },
    "8da4w-q4_0": {"recipe": "8da4w", "weight_rule": "q4_0"},
    "8da4w-budget": {"recipe": "8da4w", "size_budget": 91.6},  # --size-budget at the default's size (87.4 MiB)
    "8da4w-budget105": {"recipe": "8da4w", "size_budget": 105},  # llama.cpp Q4_K_M's size
    "8da4w-budget120": {"recipe": "8da4w", "size_budget": 120},
    "8da4w-budget188": {"recipe": "8da4w", "size_budget": 188.1},  # Gemma 3 270M's default size (179.4 MiB)
    "8da4w-budget185": {"recipe": "8da4w", "size_budget": 185.4},  # its default's size since 0040 (176.8 MiB)
    # the default less one of its 8-bit rules of the blocks (with 8da4w-head4: less the w2 rule)
    "8da4w-without-wv8": {"recipe": "8da4w", "keep_8bit": []},
    "8da4w-without-edges8": {"recipe": "8da4w", "overrides": [["feed_forward\\.w[13]$", "8da4w"]]},
    "8da4w-emb8w": {"recipe": "8da4w", "embedding": "8w"},
    "8da4w-table8": {"recipe": "8da4w", "embedding": "8w", "head": "8da8w"},  # a tied table at 8 bits, stored once
    "8da4w-table4": {"recipe": "8da4w", "table_8bit_rows": 0},  # the whole tied table at 4 bits (before 0038)
    "8da4w-rows8192": {"recipe": "8da4w", "table_8bit_rows": 8192},  # the table's first 8192 rows at 8 bits
    "8da4w-rows16384": {"recipe": "8da4w", "table_8bit_rows": 16384},
    "8da4w-rows32768": {"recipe": "8da4w", "table_8bit_rows": 32768},
    # block linears at 8 bits, the tied table as the default's (docs/decisions/0042): all of them, the
    # MLP's, the attention's, or those of Gemma 3 270M's blocks of lowest layer SQNR
    "8da4w-blocks8": {"recipe": "8da4w", "overrides": [["^layers\\.", "8da8w"]]},
    "8da4w-mlp8": {"recipe": "8da4w", "overrides": [["^layers\\.\\d+\\.feed_forward\\.", "8da8w"]]},
    "8da4w-attention8": {"recipe": "8da4w", "overrides": [["^layers\\.\\d+\\.attention\\.", "8da8w"]]},
    "8da4w-blocks11to17-8": {"recipe": "8da4w", "overrides": [["^layers\\.(1[1-7])\\.", "8da8w"]]},
    "8da8w": {"recipe": "8da8w"},  # the default: rotated, smoothed, embedding 8w
    "8da8w-norot": {"recipe": "8da8w", "rotate": False},  # the default before rotation
    "8da8w-nosq": {"recipe": "8da8w", "smooth": None, "rotate": False},  # the default before smoothing
    "8da8w-emb4w": {"recipe": "8da8w", "embedding": "4w"},
}

# llama.cpp's types measured with --llamacpp: llama.h's llama_ftype values (LLAMA_FTYPE_MOSTLY_*)
LLAMACPP_FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
FP32_AGREEMENT = 0.005  # both fp32 perplexities on the same ids, relative: the protocols agree

# SmolLM2-135M-Instruct, 1022 tokens of heldout.txt, windows of 512 (the issue; without --llamacpp)
LLAMACPP_REFERENCE = [
    {"system": "llama.cpp", "variant": "F32", "file_mib": None, "perplexity": 19.74, "reference": True},
    {"system": "llama.cpp", "variant": "Q8_0", "file_mib": 145, "perplexity": 19.78, "reference": True},
    {"system": "llama.cpp", "variant": "Q6_K", "file_mib": 138, "perplexity": 20.09, "reference": True},
    {"system": "llama.cpp", "variant": "Q4_K_M", "file_mib": 105, "perplexity": 21.28, "reference": True},
    {"system": "llama.cpp", "variant": "Q4_0", "file_mib": 92, "perplexity": 23.52, "reference": True},
]


def _child(argv: list[str], env=None) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(argv)}\n{done.stderr[-2000:]}")
    return done.stdout


def export_one(checkpoint: str, out: str, quant: dict) -> None:
    """In a child process: genai_pipeline.export with QuantOptions(**quant), unverified (`genai eval`
    scores it next). A calibrated QDQ model of the folder's previous export is reused."""
    import genai_pipeline
    from genai_pipeline.options import QuantOptions

    (Path(out) / ".quant.json").unlink(
        missing_ok=True
    )  # what the folder held: not part of an export, which replaces it whole
    genai_pipeline.export(checkpoint=checkpoint, out=out, quant=QuantOptions(**quant), verify=False)


def _described(quant: dict) -> dict:
    """What .quant.json records of an export: its options, and how today's code describes them (the
    manifest's recipe may say more: a model whose family refuses rotation is recorded without it)."""
    from genai_pipeline.options import QuantOptions
    from genai_pipeline.quantize.recipes import describe

    return {"quant": quant, "described": describe(QuantOptions(**quant))}


def _exported(folder: Path, quant: dict) -> bool:
    """Whether folder holds the export of `quant` as today's code describes it (a default that changed
    since, under the same name, is exported again)."""
    recorded = folder / ".quant.json"
    return (
        (folder / "manifest.json").is_file()
        and recorded.is_file()
        and json.loads(recorded.read_text()) == _described(quant)
    )


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.accuracy", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="a Hugging Face folder (fp32 safetensors)")
    p.add_argument("--text", default=str(ROOT / "assets" / "reference" / "heldout.txt"))
    p.add_argument(
        "--max-tokens",
        type=int,
        help="of each text (default: 4096 with --qdq, docs/decisions/0041; else 1024, the issue's reference ids)",
    )
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS), help="none: llama.cpp only")
    p.add_argument("--repeats", type=int, default=3, help="rounds of genai bench over the variants")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default=str(HERE / ".work" / "accuracy"), help="exports are cached here")
    p.add_argument(
        "--llamacpp",
        action="store_true",
        help="measure llama.cpp's Q4_0 ... Q8_0 of the same fp32 folder on the same ids "
        "(llama-cpp-python in bench/.envs/llamacpp, built by bench/compare.py); else the issue's figures",
    )
    p.add_argument("--json", default=str(HERE / "results" / "accuracy.json"))
    p.add_argument(
        "--levers",
        nargs="*",
        choices=list(LEVERS),
        help="the eager fake-quant study instead (all levers if none named)",
    )
    p.add_argument(
        "--qdq",
        action="store_true",
        help="score each variant's QDQ model (the export's quantize stage, no lowering) on --text and --second-text",
    )
    p.add_argument("--second-text", default=str(ROOT / "assets" / "heldout" / "vim-first-steps.txt"))
    p.add_argument(
        "--calib-text", default=str(ROOT / "assets" / "reference" / "sample.txt"), help="for the levers that calibrate"
    )
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--export-one", nargs=3, metavar=("CHECKPOINT", "OUT", "QUANT_JSON"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.max_tokens is None:
        args.max_tokens = 4096 if args.qdq else 1024
    if args.export_one:
        return export_one(args.export_one[0], args.export_one[1], json.loads(args.export_one[2]))
    if not args.checkpoint:
        p.error("--checkpoint is required")
    if args.levers is not None:
        return levers(args)
    if args.qdq:
        return qdq_study(args)
    if args.llamacpp and not args.variants and Path(args.checkpoint).suffix == ".gguf":
        p.error("a GGUF checkpoint's tokenizer is read from an export: name a --variants one, or use --qdq")

    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cli = [sys.executable, "-m", "genai_pipeline.cli"]
    work = Path(args.work) / Path(args.checkpoint).name
    rows = {}
    for name in args.variants:
        quant, folder = VARIANTS[name], work / name
        if not _exported(folder, quant):
            t = time.perf_counter()
            _child(
                [
                    sys.executable,
                    "-m",
                    "bench.accuracy",
                    "--export-one",
                    args.checkpoint,
                    str(folder),
                    json.dumps(quant),
                ],
                env,
            )
            (folder / ".quant.json").write_text(json.dumps(_described(quant)))
            print(f"exported {name} in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
        result = json.loads(
            _child(
                [
                    *cli,
                    "eval",
                    str(folder),
                    "--text",
                    args.text,
                    "--max-tokens",
                    str(args.max_tokens),
                    "--window",
                    str(args.window),
                    "--json",
                ],
                env,
            )
        )
        manifest = json.loads((folder / "manifest.json").read_text())
        rows[name] = {
            "system": "genai",
            "variant": name,
            "quant": quant,
            "recipe": manifest["recipe"],
            "file_mib": round((folder / "text_decoder.pte").stat().st_size / 2**20, 1),
            "perplexity": round(result["perplexity"]["program"], 3),
            "float_perplexity": round(result["perplexity"]["float"], 3),
            "qdq_perplexity": round(result["perplexity"]["qdq"], 3) if result["perplexity"]["qdq"] else None,
            "top1_agreement": round(result["top1_agreement"], 4),
            "kl_divergence": round(result["kl_divergence"], 4),
            "tokens": result["tokens"],
            "decode": [],
            "prefill": [],
        }
        print(f"scored {name}: ppl {rows[name]['perplexity']}", file=sys.stderr, flush=True)
    for _ in range(args.repeats):  # round-robin: every variant sees the same load, in turn
        for name in args.variants:
            out = json.loads(
                _child(
                    [*cli, "bench", str(work / name), "--json", "--repeats", "3", "--threads", str(args.threads)], env
                )
            )
            rows[name]["decode"].append(out["decode_tokens_per_s"])
            rows[name]["prefill"].append(out["prefill_tokens_per_s"])
    for row in rows.values():
        row["decode_tokens_per_s"] = statistics.median(row["decode"]) if row["decode"] else None
        row["prefill_tokens_per_s"] = statistics.median(row["prefill"]) if row["prefill"] else None

    fp = next(iter(rows.values()))["float_perplexity"] if rows else None
    tokenizer_folder = work / args.variants[0] if args.variants else None
    peers = (
        llamacpp_rows(args, work, eval_ids(args.checkpoint, args.text, args.max_tokens, tokenizer_folder))
        if args.llamacpp
        else LLAMACPP_REFERENCE
    )
    peer_fp = next(r["perplexity"] for r in peers if r["variant"] == "F32")
    if args.llamacpp and fp is not None and abs(peer_fp / fp - 1) > FP32_AGREEMENT:
        raise SystemExit(
            f"the fp32 perplexities disagree on the same ids: genai {fp:.3f}, llama.cpp {peer_fp:.3f}: "
            "the two protocols do not score the same thing"
        )
    all_rows = list(rows.values()) + peers
    for row in all_rows:
        row["vs_float"] = round(row["perplexity"] / (fp if row["system"] == "genai" else peer_fp) - 1, 4)
    print(
        f"{'system':<10} {'variant':<14} {'MiB':>6} {'ppl':>7} {'vs fp32':>8} {'top-1':>6} {'KL':>6} {'decode':>7} {'prefill':>8}"
    )
    for r in all_rows:
        f = lambda k, fmt: format(r[k], fmt) if r.get(k) is not None else "-"
        print(
            f"{r['system']:<10} {r['variant']:<14} {f('file_mib', '6.1f'):>6} {r['perplexity']:7.2f} {100 * r['vs_float']:+7.1f}% "
            f"{f('top1_agreement', '6.3f'):>6} {f('kl_divergence', '6.3f'):>6} {f('decode_tokens_per_s', '7.1f'):>7} "
            f"{f('prefill_tokens_per_s', '8.1f'):>8}"
            + ("  (the issue's figures, not re-run)" if r.get("reference") else "")
        )
    result = {
        "checkpoint": args.checkpoint,
        "text": args.text,
        "max_tokens": args.max_tokens,
        "window": args.window,
        "float_perplexity": fp,
        "llamacpp_float_perplexity": peer_fp,
        "threads": args.threads,
        "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load": os.getloadavg()},
        "llamacpp": "measured on the same ids" if args.llamacpp else "the issue's figures (not re-run)",
        "rows": all_rows,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    png = out.with_suffix(".png")
    png.write_bytes(
        chart([r for r in all_rows if r.get("file_mib") and r["variant"] != "F32"])
    )  # fp32 would squash the axis
    print(f"wrote {out} and {png}")


# ---- llama.cpp on the same ids (--llamacpp)


def eval_ids(checkpoint: str, text: str, max_tokens: int, folder: Path | None = None) -> list[int]:
    """The ids `genai eval` scores: the export `folder`'s tokenizer (a GGUF holds none of its own
    files), else the checkpoint's, on the text, the first max_tokens."""
    from genai_pipeline.checkpoints import infer_checkpoint_spec
    from genai_pipeline.tokenizer import Tokenizer

    spec, _ = infer_checkpoint_spec(Path(checkpoint))
    return Tokenizer.from_folder(Path(folder or checkpoint), bos_id=spec.bos_id).encode(
        Path(text).read_text(encoding="utf-8", errors="replace")
    )[:max_tokens]


def llamacpp_rows(args, work: Path, ids: list[int]) -> list[dict]:
    """llama.cpp's F32 and LLAMACPP_FTYPES of the checkpoint, scored on the token `ids` genai scores,
    with decode / prefill speed from bench/peers.py's runner (medians of --repeats). A GGUF
    checkpoint's F32 is its own tensors dequantized by llama.cpp (the float weights genai reads)."""
    if not (ENVS / "llamacpp" / "done.json").is_file():
        raise SystemExit(
            f"--llamacpp needs llama-cpp-python in {ENVS / 'llamacpp'}, which "
            "`python -m bench.compare --systems llamacpp` builds (its done.json is not there)"
        )
    (work / "logs").mkdir(parents=True, exist_ok=True)
    inst = install_llamacpp(work)  # the finished build's record, read from done.json
    checkpoint = Path(args.checkpoint).resolve()
    model = {"gguf" if checkpoint.suffix == ".gguf" else "folder": str(checkpoint)}
    out = work / "llamacpp"
    files = {
        name: export_llamacpp(model, name, ftype, out, work, inst, args.threads)["file"]
        for name, ftype in {"F32": None, **LLAMACPP_FTYPES}.items()
    }
    # scored once per (ids, window, files); one thread: llama.cpp's threads spin-wait, which a shared host punishes
    key = zlib.crc32(json.dumps([ids, args.window, list(files.values())]).encode())
    ids_file, scored = work / f"ids-{key:08x}.json", out / f"scores-{key:08x}.json"
    if not scored.is_file():
        ids_file.write_text(json.dumps(ids))
        _, _, stdout = run_child(
            [inst["python"], "-m", "bench.accuracy", "_score-gguf", ids_file, args.window, 1, *files.values()],
            log=work / "logs" / "llamacpp-score.log",
        )
        scored.write_text(stdout)
    scores = json.loads(scored.read_text())
    from genai_pipeline.checkpoints import infer_checkpoint_spec

    vocab = infer_checkpoint_spec(checkpoint)[0].config.vocab_size
    rows = []
    for name, file in files.items():
        speed = [
            json.loads(
                run_child(
                    [inst["python"], "-m", "bench.peers", "_run-llamacpp", file, vocab, 128, 128, args.threads, 0]
                )[2]
            )
            for _ in range(args.repeats)
        ]
        rows.append(
            {
                "system": "llama.cpp",
                "variant": name,
                "file_mib": round(Path(file).stat().st_size / 2**20, 1),
                **scores[file],
                "decode_tokens_per_s": statistics.median(s["decode_tokens_per_s"] for s in speed) if speed else None,
                "prefill_tokens_per_s": statistics.median(s["prefill_tokens_per_s"] for s in speed) if speed else None,
            }
        )
        print(f"scored llama.cpp {name}: ppl {rows[-1]['perplexity']}", file=sys.stderr, flush=True)
    return rows


def worker_score_gguf(ids_file: str, window: int, threads: int, files: list[str]) -> None:
    """In llama.cpp's venv: perplexity of each GGUF on the ids in windows (the cache empty at
    each), top-1 agreement and KL against the first file's (F32) log-probabilities; prints JSON."""
    import numpy as np
    from llama_cpp import Llama

    ids = json.loads(Path(ids_file).read_text())
    windows = [ids[i : i + window] for i in range(0, len(ids) - 1, window)]
    reference, out = None, {}
    for file in files:
        llm = Llama(
            model_path=file,
            n_ctx=window,
            n_batch=window,
            n_ubatch=window,
            logits_all=True,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        nll, count, agree, kl, mine = 0.0, 0, 0, 0.0, []
        for k, w in enumerate(windows):
            llm.reset()
            llm.eval(w)
            logits = np.array(llm.scores[: len(w) - 1], dtype=np.float64)  # every position's (logits_all)
            logits -= logits.max(-1, keepdims=True)
            lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            nll -= float(lp[np.arange(len(w) - 1), w[1:]].sum())
            count += len(w) - 1
            if reference is None:
                mine.append(lp.astype(np.float32))
            else:
                agree += int((reference[k].argmax(-1) == lp.argmax(-1)).sum())
                kl += float((np.exp(reference[k]) * (reference[k] - lp)).sum())
        reference = reference if reference is not None else mine
        out[file] = {
            "perplexity": round(float(np.exp(nll / count)), 3),
            "tokens": count,
            "top1_agreement": round(agree / count, 4) if file != files[0] else 1.0,
            "kl_divergence": round(kl / count, 4) if file != files[0] else 0.0,
        }
        del llm
    print(json.dumps(out))


# ---- the eager fake-quant study: quantize the float model in eager mode and score it (no lowering)

LEVERS = {  # name -> fake_quantize keyword arguments; weights as the program would hold them
    "body torchao (today's rule)": dict(rule="torchao", emb="float"),
    "body Q4_0, negative scales (not runnable)": dict(rule="q4_0neg", emb="float"),
    "body Q4_0, positive scales": dict(rule="q4_0", emb="float"),
    "body mse": dict(rule="mse", emb="float"),
    "body mse, weights only (no act quant)": dict(rule="mse", emb="float", act=False),
    "body mse + emb 4w": dict(rule="mse", emb="4"),
    "body mse + emb 4w + head 4-bit": dict(rule="mse", emb="4", head=4),
    "body torchao + emb 4w + head 4-bit (today)": dict(rule="torchao", emb="4", head=4),
    "body mse g16": dict(rule="mse", emb="float", group_size=16),
    "body mse g64": dict(rule="mse", emb="float", group_size=64),
    "body mse, wv 8-bit": dict(rule="mse", emb="float", eight=("wv",)),
    "body mse, wv + w2 8-bit": dict(rule="mse", emb="float", eight=("wv", "w2")),
    "body mse weighted by calibration (imatrix)": dict(rule="wmse", emb="4"),
    "body GPTQ (calibration)": dict(rule="gptq", emb="4"),
    "body GPTQ, wv 8-bit": dict(rule="gptq", emb="4", eight=("wv",)),
    "body GPTQ, head 4-bit": dict(rule="gptq", emb="4", head=4),
    "body mse, wv 8-bit + emb 4w": dict(rule="mse", emb="4", eight=("wv",)),
    "8da8w body": dict(rule="mse", emb="float", eight=(".",)),
    "8da8w body, weights only (no act quant)": dict(rule="mse", emb="float", eight=(".",), act=False),
    # the recipes' own path (quantize.smooth, gptq_weights, quantize_module), with and without smoothing
    "default 8da4w, not smoothed": dict(recipe="8da4w", smooth=None),
    "default 8da4w (smoothed, alpha 0.5)": dict(recipe="8da4w", smooth=0.5),
    "default 8da8w, not smoothed": dict(recipe="8da8w", smooth=None),
    "default 8da8w (smoothed, alpha 0.5)": dict(recipe="8da8w", smooth=0.5),
    "default 8da8w, smoothed alpha 0.7": dict(recipe="8da8w", smooth=0.7),
    "default 8da4w, rotated (smoothed)": dict(recipe="8da4w", smooth=0.5, rotated=True),
    "default 8da8w, rotated (smoothed)": dict(recipe="8da8w", smooth=0.5, rotated=True),
    "default 8da8w, rotated, not smoothed": dict(recipe="8da8w", smooth=None, rotated=True),
    "default 8da8w, rotated, smoothed alpha 0.3": dict(recipe="8da8w", smooth=0.3, rotated=True),
    "default 8da8w, rotated, smoothed alpha 0.7": dict(recipe="8da8w", smooth=0.7, rotated=True),
}


def recipe_default(model, calib: list[int], window: int, recipe: str, smooth: float | None, rotated: bool = False):
    """What `--recipe R` does to the eager model (QuantOptions' defaults but the smoothing strength)."""
    from genai_pipeline.options import QuantOptions
    from genai_pipeline.quantize.calibration import input_absmax
    from genai_pipeline.quantize.gptq import gptq_weights
    from genai_pipeline.quantize.recipes import linear_recipes, quantize_module
    from genai_pipeline.quantize.rotation import rotate
    from genai_pipeline.quantize.smoothing import smooth as smooth_model
    from genai_pipeline.quantize.smoothing import smoothing_scales

    options = QuantOptions(recipe=recipe, smooth=smooth, rotate=rotated)
    if rotated:
        rotate(model)
    if smooth is not None:
        smooth_model(model, smoothing_scales(model, input_absmax(model, [calib], window), smooth))
    computed = None
    if recipe == "8da4w":
        names = {n for n, r in linear_recipes(model, options).items() if r == "8da4w"}
        computed = gptq_weights(model, names, [calib], window, options.group_size)
    quantize_module(model, options, computed)
    return model


def _neg_q4_0(w, group_size):
    """llama.cpp's Q4_0 exactly: d = (signed value of largest magnitude) / -8, negative scales."""
    import torch

    from genai_pipeline.quantize.weights import groups

    g = groups(w, group_size)
    d = g.gather(-1, g.abs().argmax(-1, keepdim=True)) / -8
    d = torch.where(d == 0, torch.ones_like(d), d)
    return torch.clamp(torch.round(g / d), -8, 7).reshape(w.shape).to(torch.int8), d.squeeze(-1)


def fake_quantize(model, hessians, rule="mse", group_size=32, head=8, emb="float", eight=(), act=True):
    """Our 8da4w on an eager model: 4-bit linears by `rule`, layers matching `eight` and the head
    (head=8) at 8 bits per channel, the embedding 4w / 8w / float."""
    import re

    import torch
    from torch import nn

    from genai_pipeline.quantize.gptq import gptq_qparams
    from genai_pipeline.quantize.weights import RULES, intx_weight, mse_qparams, torchao_qparams, wmse_qparams

    rules = {**RULES, "q4_0neg": _neg_q4_0}
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear):
            bits = 8 if (name == "output" and head == 8) or any(re.search(p, name) for p in eight) else 4
            if bits == 8:
                q, d = torchao_qparams(m.weight, m.in_features, 8, bf16=False)
            elif rule == "wmse":
                q, d = wmse_qparams(m.weight, group_size, torch.diag(hessians[name]))
            elif rule == "gptq":
                q, d = gptq_qparams(m.weight, hessians[name], group_size)
            else:
                q, d = rules[rule](m.weight, group_size)
            m.weight = nn.Parameter(intx_weight(q, d, bits, dynamic=act), requires_grad=False)
        elif isinstance(m, nn.Embedding) and emb != "float":
            q, d = (
                mse_qparams(m.weight, group_size, 4, bf16=False)
                if emb == "4"
                else torchao_qparams(m.weight, m.embedding_dim, 8, bf16=False)
            )
            m.weight = nn.Parameter(intx_weight(q, d, int(emb), dynamic=False), requires_grad=False)
    return model


def levers(args) -> None:
    """Each lever of LEVERS on the eager model: perplexity, top-1 and KL against float."""
    import copy
    import math

    import torch
    from torch import nn

    from genai_pipeline.checkpoints import infer_checkpoint_spec, load_decoder
    from genai_pipeline.runtime.session import EagerSession
    from genai_pipeline.tokenizer import Tokenizer

    spec, _ = infer_checkpoint_spec(Path(args.checkpoint))
    model = load_decoder(spec, Path(args.checkpoint), args.window).eval()
    tok = Tokenizer.from_folder(Path(args.checkpoint), bos_id=spec.bos_id)
    ids = tok.encode(Path(args.text).read_text(encoding="utf-8"))[: args.max_tokens]
    windows = [ids[i : i + args.window] for i in range(0, len(ids) - 1, args.window)]
    targets = [torch.tensor(w[1:]) for w in windows]

    @torch.no_grad()
    def logprobs(m):
        session, out = EagerSession(m, args.window), []
        for w in windows:
            session.reset()
            out.append(torch.log_softmax(session.score(w)[:-1].float(), -1))
        return out

    hessians = {}  # per linear: X^T X of its inputs over the calibration text

    def hook(name):
        def record(_, inputs, __):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            hessians[name] = hessians.get(name, 0) + x.T @ x

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    calib = tok.encode(Path(args.calib_text).read_text(encoding="utf-8"))[: args.calib_tokens]
    with torch.no_grad():
        session = EagerSession(model, args.window)
        for i in range(0, len(calib), args.window):
            session.reset()
            session.score(calib[i : i + args.window])
    for h in handles:
        h.remove()

    base = logprobs(model)
    n = sum(len(t) for t in targets)

    def metrics(lp):
        nll = sum(-l.gather(1, t[:, None]).sum().item() for l, t in zip(lp, targets))
        top1 = sum((p.argmax(-1) == q.argmax(-1)).sum().item() for p, q in zip(base, lp)) / n
        kl = sum((p.exp() * (p - q)).sum().item() for p, q in zip(base, lp)) / n
        return math.exp(nll / n), top1, kl

    fp = metrics(base)[0]
    rows = [{"lever": "float", "perplexity": fp}]
    print(
        f"float perplexity {fp:.3f} on {n} tokens; calibration (imatrix, GPTQ): {len(calib)} tokens of {args.calib_text}"
    )
    for name in args.levers or LEVERS:
        t = time.perf_counter()
        lever = LEVERS[name]
        quantized = (
            recipe_default(copy.deepcopy(model), calib, args.window, **lever)
            if "recipe" in lever
            else fake_quantize(copy.deepcopy(model), hessians, **lever)
        )
        ppl, top1, kl = metrics(logprobs(quantized))
        rows.append(
            {
                "lever": name,
                "settings": LEVERS[name],
                "perplexity": ppl,
                "vs_float": ppl / fp - 1,
                "top1_agreement": top1,
                "kl_divergence": kl,
            }
        )
        print(
            f"{name:<46} ppl {ppl:7.3f} ({100 * (ppl / fp - 1):+6.1f} %)  top-1 {100 * top1:5.1f} %  KL {kl:.4f}  [{time.perf_counter() - t:.0f} s]",
            flush=True,
        )
    out = Path(args.json).with_name("levers.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"checkpoint": args.checkpoint, "text": args.text, "tokens": n, "window": args.window, "rows": rows},
            indent=2,
            default=str,
        )
        + "\n"
    )
    print(f"wrote {out}")


def qdq_study(args) -> None:
    """Each variant through the export's own quantize stage (genai_pipeline.quantize, the checkpoint as
    `genai export` reads it: a folder or a GGUF), its QDQ model scored against float on both texts:
    what a program of that recipe gives, within the kernels' rounding, without minutes of lowering."""
    import copy
    import math

    import torch

    from genai_pipeline.checkpoints import infer_checkpoint_spec
    from genai_pipeline.names import ArtifactKey
    from genai_pipeline.options import PrepareOptions, QuantOptions
    from genai_pipeline.prepare import prepare
    from genai_pipeline.quantize import quantize
    from genai_pipeline.runtime.session import EagerSession
    from genai_pipeline.targets import get_target
    from genai_pipeline.tokenizer import Tokenizer

    checkpoint = Path(args.checkpoint)
    spec, _ = infer_checkpoint_spec(checkpoint)
    base = prepare(spec, PrepareOptions(checkpoint=checkpoint, max_seq_len=args.window))
    tokenizer = Tokenizer.from_folder(base.tokenizer_file.parent, bos_id=spec.bos_id)
    texts = {
        Path(t).name: tokenizer.encode(Path(t).read_text(encoding="utf-8"))[: args.max_tokens]
        for t in (args.text, args.second_text)
    }

    @torch.no_grad()
    def logprobs(prepared) -> dict:
        session, out = EagerSession(prepared.artifacts[ArtifactKey.TEXT_DECODER].module, args.window), {}
        for name, ids in texts.items():
            out[name] = []
            for i in range(0, len(ids) - 1, args.window):
                window = ids[i : i + args.window]
                session.reset()
                out[name].append((torch.log_softmax(session.score(window)[:-1].float(), -1), torch.tensor(window[1:])))
        return out

    reference = logprobs(base)
    rows = []
    for variant in args.variants:
        t = time.perf_counter()
        quantized = quantize(copy.deepcopy(base), QuantOptions(**VARIANTS[variant]), get_target("xnnpack"))
        row = {"variant": variant, "recipe": quantized.recipe}
        for name, scored in logprobs(quantized).items():
            nll = fnll = agree = kl = n = 0
            for (p, target), (q, _) in zip(reference[name], scored):
                nll -= q.gather(1, target[:, None]).sum().item()
                fnll -= p.gather(1, target[:, None]).sum().item()
                agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
                kl += (p.exp() * (p - q)).sum().item()
                n += len(target)
            row[name] = {
                "tokens": n,
                "float_perplexity": math.exp(fnll / n),
                "perplexity": math.exp(nll / n),
                "vs_float": math.exp((nll - fnll) / n) - 1,
                "top1_agreement": agree / n,
                "kl_divergence": kl / n,
            }
        rows.append(row)
        del quantized
        print(
            f"{variant:<16} "
            + "  ".join(
                f"{k}: {100 * v['vs_float']:+6.1f} % top-1 {100 * v['top1_agreement']:5.1f} % KL {v['kl_divergence']:.3f}"
                for k, v in row.items()
                if isinstance(v, dict)
            )
            + f"  [{time.perf_counter() - t:.0f} s]",
            flush=True,
        )
    peers = {}
    if args.llamacpp:  # llama.cpp's types of the same float weights, scored on the same ids
        for name, ids in texts.items():
            fnll = sum(-p.gather(1, t[:, None]).sum().item() for p, t in reference[name])
            fp = math.exp(fnll / sum(len(t) for _, t in reference[name]))
            peers[name] = llamacpp_rows(args, Path(args.work) / checkpoint.name, ids)
            peer_fp = next(r["perplexity"] for r in peers[name] if r["variant"] == "F32")
            if abs(peer_fp / fp - 1) > FP32_AGREEMENT:
                raise SystemExit(
                    f"{name}: the float perplexities disagree on the same ids: {fp:.3f}, llama.cpp {peer_fp:.3f}"
                )
            for r in peers[name]:
                r["vs_float"] = r["perplexity"] / peer_fp - 1
                print(
                    f"llama.cpp {r['variant']:<7} {r['file_mib']:7.1f} MiB  {name}: {100 * r['vs_float']:+6.1f} % "
                    f"top-1 {100 * r['top1_agreement']:5.1f} % KL {r['kl_divergence']:.3f}",
                    flush=True,
                )
    out = Path(args.json).with_name(f"qdq-{checkpoint.stem}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "load": os.getloadavg()}
    result = {
        "checkpoint": str(checkpoint),
        "window": args.window,
        "max_tokens": args.max_tokens,
        "machine": machine,
        "rows": rows,
        "llamacpp": peers,
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def chart(rows, w=900, h=560) -> bytes:
    """Perplexity (vs its float) against file size: genai blue, llama.cpp red, labelled."""
    img = png_chart.canvas(w, h)
    left, right, top, bottom = 70, w - 20, 20, h - 50
    xs = [r["file_mib"] for r in rows]
    ys = [100 * r["vs_float"] for r in rows]
    x0, x1 = min(xs) * 0.95, max(xs) * 1.05
    y0, y1 = min(0.0, min(ys)), max(ys) * 1.1 + 1
    sx = lambda v: int(left + (v - x0) / (x1 - x0) * (right - left))
    sy = lambda v: int(bottom - (v - y0) / (y1 - y0) * (bottom - top))
    for x in range(left, right):
        png_chart.px(img, x, bottom, (0, 0, 0))
    for y in range(top, bottom):
        png_chart.px(img, left, y, (0, 0, 0))
    for i in range(6):
        v = y0 + (y1 - y0) * i / 5
        png_chart.text(img, 5, sy(v) - 5, f"{v:+.0f}%", (0, 0, 0))
        for x in range(left, right, 6):
            png_chart.px(img, x, sy(v), (200, 200, 200))
        u = x0 + (x1 - x0) * i / 5
        png_chart.text(img, sx(u) - 10, bottom + 8, f"{u:.0f}", (0, 0, 0))
    png_chart.text(img, right - 150, bottom + 30, "file MiB", (0, 0, 0))
    png_chart.text(img, left + 10, top, "perplexity vs fp32", (0, 0, 0))
    for r, x, y in zip(rows, xs, ys):
        color = (200, 30, 30) if r["system"] == "llama.cpp" else (30, 60, 200)
        cx, cy = sx(x), sy(y)
        png_chart.dot(img, cx, cy, color)
        png_chart.text(img, cx + 7, cy - 5, r["variant"], color)
    return png_chart.png(img)


if __name__ == "__main__":  # _score-gguf: in llama.cpp's venv, where genai_pipeline's dependencies are not
    main_or_worker(main, {"_score-gguf": lambda a: worker_score_gguf(a[0], int(a[1]), int(a[2]), a[3:])})
