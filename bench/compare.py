"""Side by side: genai vs llama.cpp, optimum-executorch and onnxruntime-genai, same model, same machine, each at its best.

A benchmark, not a test. For each shape (SmolLM2-135M, Llama-3.2-1B) it builds one seeded
random-weight Hugging Face folder (fp32 safetensors + a byte-level BPE tokenizer.json of the
model's vocab size), then for each system:

  genai      `genai export --checkpoint` per recipe (fp32, 8da8w, 8da4w -- their embedding follows the
             recipe: 8-bit, 4-bit --, 8da4w with an 8-bit embedding, 8da4w 4-bit throughout)
             and mode (dynamic, hybrid); run by `genai bench --json` and, for the dynamic program
             (one `forward`), by ExecuTorch's own C++ `TextLLMRunner`.
  llamacpp   a venv bench/.envs/llamacpp with llama-cpp-python built from its sdist
             (-DGGML_NATIVE=ON, no AMX); the sdist's convert_hf_to_gguf.py -> F32 GGUF, then
             llama_cpp.llama_model_quantize -> Q8_0, Q4_0; run through llama_cpp.Llama with each of
             `--llamacpp-threads`, with and without flash attention.
  optimum    a venv bench/.envs/optimum with optimum-executorch; `optimum-cli export executorch`
             (xnnpack, custom SDPA + KV cache) fp32, --qlinear 8da8w, 8da4w, 8da4w + --qembedding 8w;
             run by `TextLLMRunner` (as its users run it) and by a Python loop over the program's
             `forward(tokens, input_pos)`.
  ortgenai   a venv bench/.envs/ortgenai with onnxruntime-genai and its model builder
             (`python -m onnxruntime_genai.models.builder -p int4|fp32 -e cpu`); run by its generator loop.

The peers' installs, exports and workers are in bench/peers.py; child processes and cached stages, in
bench/harness.py. Every ExecuTorch run has OMP_NUM_THREADS=1 (`genai run`/`bench` set it for themselves;
see harness.ONE_OMP_THREAD).
With `--lookahead N ...` (default 7) and the real SmolLM2-135M-Instruct GGUF in .cache/, rows of
`genai bench --lookahead N` (a program per recipe of --recipes with a `verify` method of up to N + 1
tokens; the drafter checks as many drafted tokens as pay on the CPU) on a rewrite prompt and a free-chat
prompt (bench/prompts) join the SmolLM2 rows of their recipe class. Decode slows as the context grows,
so those rows are judged against the peers' runs of the same prompt (its ids under the model's chat
template) and as many decode steps, in rows marked with the task ("2 thr flash-attn: rewrite"), not
against the --prompt-len rows.

Every export/convert/install and every measurement runs in a child process (wall time; peak RSS
from os.wait4). Measurements go round-robin over all rows, `--repeats` rounds; each child does one
warm-up round and one timed round (a `--prompt-len` prefill -- seeded random token ids, or for
TextLLMRunner, which takes text, prose of exactly that many tokens -- then `--gen-len` greedy decode
steps, the first generated token excluded); the table shows medians over rounds, and each genai
row's ratio to the best peer row (any peer, runner or thread setting) of its shape and recipe class.
Stages cache their outputs (a done.json beside them) in `--work`, so a re-run resumes. A peer that
cannot be installed, exported or run is recorded with the reason and the others go on. Prints a
table and its own run time, and writes bench/results/compare.json (with the CPU's model and flags
and the host's load averages).

    .venv/bin/python -m bench.compare [--shapes smollm2-135m llama3_2-1b] [--systems genai llamacpp optimum ortgenai]
        [--recipes fp32 8da8w 8da4w] [--modes dynamic hybrid] [--variants 8da4w Q4_0 ...] [--repeats 3]
        [--threads 2] [--llamacpp-threads 1 2] [--lookahead 7] [--skip-install]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.harness import (
    ENVS,
    HERE,
    MAIN_PY,
    ONE_OMP_THREAD,
    ROOT,
    ChildFailed,
    cached,
    genai_source,
    last_error_line,
    machine,
    main_or_worker,
    run_child,
    say,
)
from bench.peers import (
    export_llamacpp,
    export_optimum,
    export_ortgenai,
    install_llamacpp,
    install_optimum,
    install_ortgenai,
)

COMMON = dict(
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=True,
    initializer_range=0.02,
    attention_bias=False,
    mlp_bias=False,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=None,
)
SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    "llama3_2-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=131072,
        head_dim=64,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}
# recipe class -> variants per system: (variant name, arguments)
GENAI_RECIPES = {
    "fp32": [("fp32", ["--recipe", "fp32"])],
    "8da8w": [("8da8w", ["--recipe", "8da8w"])],
    "8da4w": [
        ("8da4w", ["--recipe", "8da4w"]),
        ("8da4w+emb8w", ["--recipe", "8da4w", "--embedding", "8w"]),
        # the default keeps attention.wv, feed_forward.w2 and the edge layers' w1/w3 at 8 bits
        # (accuracy); this one is 4-bit throughout, as the peers' programs: the bytes a token
        # reads, like for like
        (
            "8da4w-all4bit",
            [
                "--recipe",
                "8da4w",
                "--quant-override",
                "attention.wv=8da4w",
                "--quant-override",
                r"feed_forward.w[123]=8da4w",
            ],
        ),
        # the Q4_0-size program of the accuracy table (bench/accuracy.py's 8da4w-head4)
        ("8da4w-w2at4", ["--recipe", "8da4w", "--quant-override", "feed_forward.w2=8da4w"]),
    ],
}
LLAMACPP_RECIPES = {"fp32": [("F32", None)], "8da8w": [("Q8_0", 7)], "8da4w": [("Q4_0", 2)]}  # llama_ftype values
# the builder's int4: blocks of 32 (its default), MatMulNBits with accuracy level 4 (int8 activations, as 8da4w)
ORTGENAI_RECIPES = {
    "fp32": [("fp32", ["-p", "fp32"])],
    "8da8w": [],
    "8da4w": [("int4", ["-p", "int4", "--extra_options", "int4_block_size=32", "int4_accuracy_level=4"])],
}
OPTIMUM_RECIPES = {
    "fp32": [("fp32", [])],
    "8da8w": [("8da8w", ["--qlinear", "8da8w"])],
    "8da4w": [("8da4w", ["--qlinear", "8da4w"]), ("8da4w+emb8w", ["--qlinear", "8da4w", "--qembedding", "8w"])],
}


# ----------------------------------------------------------------------------- the model


def worker_build_model(shape: str, out: str, seed: int) -> None:
    """Runs in the main venv: the random-weight HF folder."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf = {**COMMON, **SHAPES[shape]}
    vocab = hf["vocab_size"]
    config = LlamaConfig(**hf)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    with torch.no_grad():
        model = LlamaForCausalLM(config).float().eval()
        for name, p in model.named_parameters():  # std 0.02 for every matrix, 1 for norms
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)
    model.save_pretrained(out, safe_serialization=True)

    # A byte-level BPE trained on prose that ships with Python, padded with reserved tokens to the
    # model's vocab size (the harness feeds random token ids; the tokenizer only has to be valid).
    import pydoc_data.topics

    text = list(pydoc_data.topics.topics.values())
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=min(vocab, 4096),
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    spec = json.loads(tok.to_str())
    table = spec["model"]["vocab"]
    for i in range(len(table), vocab):
        table[f"<|reserved_{i}|>"] = i
    tok = Tokenizer.from_str(json.dumps(spec))
    assert tok.get_vocab_size() == vocab, (tok.get_vocab_size(), vocab)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token=None
    ).save_pretrained(out)


def build_model(shape: str, work: Path, seed: int) -> dict:
    folder = work / shape / "hf"

    def make():
        wall, rss, _ = run_child(
            [MAIN_PY, "-m", "bench.compare", "_build-model", shape, folder, str(seed)],
            log=work / "logs" / f"{shape}-build-model.log",
        )
        n = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        return {
            "folder": str(folder),
            "seed": seed,
            "build_s": round(wall, 1),
            "build_peak_rss_mb": round(rss),
            "safetensors_mb": round(n / 2**20, 1),
        }

    return cached(folder / "done.json", make)


# ----------------------------------------------------------------------------- genai's exports


def export_genai_program(export_args: list, out: Path, work: Path, src: dict) -> dict:
    wall, rss, _ = run_child(
        [MAIN_PY, "-m", "genai_pipeline.cli", "export", *export_args],
        log=work / "logs" / f"{out.parent.parent.name}-{out.name}-export.log",
        cwd=src["cwd"],
        env=src["env"],
    )
    return {
        "file": str(out / "text_decoder.pte"),
        "export_s": round(wall, 1),
        "export_peak_rss_mb": round(rss),
        "genai_sha": src["sha"],
    }


def export_genai(shape, model, recipe_args, mode, out: Path, work: Path, max_seq_len: int, src: dict) -> dict:
    return cached(
        out / "done.json",
        lambda: export_genai_program(
            [
                "--checkpoint",
                model["folder"],
                *recipe_args,
                "--mode",
                mode,
                "--max-seq-len",
                str(max_seq_len),
                "--out",
                out,
            ],
            out,
            work,
            src,
        ),
    )


# ----------------------------------------------------------------------------- measurements


def runs_of(variant: dict, args, task: tuple[str, Path] | None = None) -> list[dict]:
    """The ways one exported variant is run: each is a row of the table. With `task` (a lookahead row's task
    and a file of its prompt's ids), a peer's runs that take ids run that prompt and --lookahead-gen-len
    steps: the decode rate, at the same positions, that the lookahead rows of the task are judged by."""
    v, n = variant, ([args.prompt_len, args.gen_len] if task is None else [task[1], args.lookahead_gen_len])
    here = {"cwd": str(ROOT), "env": {}}
    if v["system"] == "genai":
        src = v["genai_src"]
        runs = [
            (
                "genai bench",
                args.threads,
                [
                    MAIN_PY,
                    "-m",
                    "genai_pipeline.cli",
                    "bench",
                    Path(v["file"]).parent,
                    "--json",
                    "--prompt-len",
                    args.prompt_len,
                    "--gen-len",
                    args.gen_len,
                    "--repeats",
                    1,
                    "--threads",
                    args.threads,
                ],
                src,
            )
        ]
        if v["variant"].endswith("/dynamic"):  # one `forward`: the program ExecuTorch's runner takes
            runs.append(
                (
                    "TextLLMRunner",
                    args.threads,
                    [
                        MAIN_PY,
                        "-m",
                        "bench.peers",
                        "_run-textllm",
                        v["file"],
                        Path(v["file"]).parent / "tokenizer.json",
                        *n,
                        args.threads,
                    ],
                    {"cwd": src["cwd"], "env": {**src["env"], **ONE_OMP_THREAD}},
                )
            )
    elif v["system"] == "optimum":
        runs = [
            (
                "TextLLMRunner",
                args.threads,
                [v["python"], "-m", "bench.peers", "_run-textllm", v["file"], v["tokenizer"], *n, args.threads],
                {**here, "env": ONE_OMP_THREAD},
            ),
            (
                "python loop",
                args.threads,
                [v["python"], "-m", "bench.peers", "_run-optimum", v["file"], v["vocab"], *n, args.threads],
                {**here, "env": ONE_OMP_THREAD},
            ),
        ]
    elif v["system"] == "llamacpp":
        runs = [
            (
                f"{t} thr{' flash-attn' if fa else ''}",
                t,
                [v["python"], "-m", "bench.peers", "_run-llamacpp", v["file"], v["vocab"], *n, t, int(fa)],
                here,
            )
            for t in args.llamacpp_threads
            for fa in (False, True)
        ]
    else:
        runs = [
            (
                "generator loop",
                args.threads,
                [
                    v["python"],
                    "-m",
                    "bench.peers",
                    "_run-ortgenai",
                    Path(v["file"]).parent,
                    v["vocab"],
                    *n,
                    args.threads,
                ],
                here,
            )
        ]
    if task is not None:  # runners that take ids (not TextLLMRunner); genai's plain decoding is in its lookahead rows
        return [
            {
                **v,
                "id": f"{v['id']}/{name}/{task[0]}",
                "runner": f"{name}: {task[0]}",
                "task": task[0],
                "threads": t,
                "argv": argv,
                "run_in": where,
            }
            for name, t, argv, where in runs
            if v["system"] != "genai" and name != "TextLLMRunner"
        ]
    return [
        {**v, "id": f"{v['id']}/{name}", "runner": name, "threads": t, "argv": argv, "run_in": where}
        for name, t, argv, where in runs
    ]


def measure(row: dict, work: Path) -> dict:
    log = work / "logs" / f"run-{row['id'].replace('/', '-').replace(' ', '_')}.log"
    load = round(os.getloadavg()[0], 2)  # the machine is shared: how busy it was
    _, rss, out = run_child(row["argv"], log=log, cwd=row["run_in"]["cwd"], env=row["run_in"]["env"])
    got = json.loads(out.strip().splitlines()[-1])
    # `genai bench` goes on to probe memory bandwidth (512 MB of buffers) after its timed rounds, so
    # its own peak, taken before that, is the runtime's; the peer workers do nothing but run.
    rss = got.get("peak_rss_mb", rss)
    share = {"bandwidth_share": got["bandwidth_share"]} if "bandwidth_share" in got else {}  # genai bench's own figure
    tokens = {k: got[k] for k in ("prompt_tokens", "generated_tokens") if k in got}  # what TextLLMRunner ran
    decode = got["decode_tokens_per_s"]
    ahead = {}
    if "lookahead" in got:  # the row's decode rate is lookahead's; plain decoding's of the same text beside it
        la = got["lookahead"]
        decode = la["decode_tokens_per_s"]
        ahead = {
            "plain_decode_tokens_per_s": la["plain_decode_tokens_per_s"],
            "speedup": la["speedup"],
            "tokens_per_call": la["tokens_per_call"],
            "tokens": la["tokens"],
            "first_difference": la["first_difference"],
            "verify_cost_in_steps": la.get("verify_cost_in_steps"),
        }
    return {
        "prefill_tokens_per_s": got["prefill_tokens_per_s"],
        "decode_tokens_per_s": decode,
        "load_s": got["load_s"],
        "run_peak_rss_mb": round(rss),
        "loadavg_1m_before": load,
        **share,
        **tokens,
        **ahead,
    }


# ----------------------------------------------------------------------------- lookahead rows

# SmolLM2-135M-Instruct, the real model (`make test` / `make chat` fetch its GGUF): lookahead needs text
# that repeats, which random weights never write. The prompts: a grounded task and free chat, of the
# ones bench/lookahead_drafts.py replays (bench/prompts).
REAL_SMOLLM2 = ROOT / ".cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
LOOKAHEAD_TASKS = {
    "rewrite": ROOT / "bench" / "prompts" / "rewrite.txt",
    "free chat": ROOT / "bench" / "prompts" / "free-chat.txt",
}


def task_prompt_ids(folder: Path, work: Path) -> dict[str, Path]:
    """Each lookahead task's prompt as the ids `genai bench --prompt-file --chat` runs (the model's chat
    template), in a JSON file: the peers run the same ids (their random-weight models share the vocabulary)."""
    from genai_pipeline.bench.text import bench_prompt
    from genai_pipeline.options import BenchOptions
    from genai_pipeline.runtime.open import open_session

    session, files = open_session(folder), {}
    for task, prompt in LOOKAHEAD_TASKS.items():
        ids, _ = bench_prompt(folder, session, BenchOptions(prompt_file=prompt, chat=True))
        files[task] = work / "lookahead" / "tasks" / f"{task.replace(' ', '-')}.json"
        files[task].parent.mkdir(parents=True, exist_ok=True)
        files[task].write_text(json.dumps(ids))
    return files


def lookahead_runs(args, work: Path, problems: list) -> tuple[list[dict], dict[str, Path]]:
    """genai bench --lookahead N on the real SmolLM2-135M-Instruct, per recipe of --recipes (dynamic, a
    `verify` method of up to N + 1 tokens), per N in --lookahead and per task: plain and lookahead decoding
    of the same prompt alternate in one process. Its rows sit in the smollm2-135m class of their recipe (the
    same shapes as the random-weight model the peers run) and are judged against the peers' runs of the
    same task's ids. Returns the runs and the tasks' id files."""
    if not REAL_SMOLLM2.exists():
        problems.append(
            {
                "shape": "smollm2-135m",
                "system": "genai",
                "variant": "lookahead",
                "stage": "model",
                "reason": f"{REAL_SMOLLM2} missing (make test fetches it)",
            }
        )
        return [], {}
    src = genai_source(args.genai_ref, work)
    runs, tasks = [], {}
    for recipe, draft_len in itertools.product(args.recipes, args.lookahead):
        verify_len = draft_len + 1
        out = work / "lookahead" / f"genai-{src['key'][:8]}-smollm2-135m-instruct-{recipe}-dynamic-verify{verify_len}"
        say(f"[lookahead] export genai SmolLM2-135M-Instruct {recipe} dynamic --verify-len {verify_len}")
        try:
            rec = cached(
                out / "done.json",
                lambda: export_genai_program(
                    [
                        "--checkpoint",
                        REAL_SMOLLM2,
                        "--recipe",
                        recipe,
                        "--mode",
                        "dynamic",
                        "--verify-len",
                        verify_len,
                        "--max-seq-len",
                        "1024",
                        "--out",
                        out,
                    ],
                    out,
                    work,
                    src,
                ),
            )
        except ChildFailed as e:
            problems.append(
                {
                    "shape": "smollm2-135m",
                    "system": "genai",
                    "variant": f"{recipe} lookahead {draft_len}",
                    "stage": "export",
                    "reason": last_error_line(e),
                    "detail": str(e)[-3000:],
                }
            )
            continue
        tasks = tasks or task_prompt_ids(out, work)
        for task, prompt in LOOKAHEAD_TASKS.items():
            argv = [
                MAIN_PY,
                "-m",
                "genai_pipeline.cli",
                "bench",
                out,
                "--json",
                "--prompt-file",
                prompt,
                "--chat",
                "--gen-len",
                args.lookahead_gen_len,
                "--lookahead",
                draft_len,
                "--repeats",
                1,
                "--threads",
                args.threads,
            ]
            runs.append(
                {
                    "id": f"smollm2-135m-genai-{recipe}-lookahead-{draft_len}/{task}",
                    "shape": "smollm2-135m",
                    "system": "genai",
                    "recipe_class": recipe,
                    "variant": f"{recipe}/dynamic real",
                    "runner": f"lookahead {draft_len}: {task}",
                    "task": task,
                    "threads": args.threads,
                    "file_mb": round(Path(rec["file"]).stat().st_size / 2**20, 1),
                    "export_s": rec["export_s"],
                    "export_peak_rss_mb": rec["export_peak_rss_mb"],
                    "argv": argv,
                    "run_in": src,
                }
            )
    return runs, tasks


# ----------------------------------------------------------------------------- driver


def prepare_variants(shape: str, args, work: Path, problems: list) -> list[dict]:
    say(f"[{shape}] model")
    model = build_model(shape, work, args.seed)
    vocab = SHAPES[shape]["vocab_size"]
    variants = []

    def add(system, recipe, name, make, extra=None):
        vid = f"{shape}-{system}-{name}"
        try:
            say(f"[{shape}] export {system} {name}")
            rec = make()
            mb = rec.get("weights_mb") or round(Path(rec["file"]).stat().st_size / 2**20, 1)
            variants.append(
                {
                    "id": vid,
                    "shape": shape,
                    "system": system,
                    "recipe_class": recipe,
                    "variant": name,
                    "vocab": vocab,
                    "file_mb": mb,
                    **rec,
                    **(extra or {}),
                }
            )
        except ChildFailed as e:
            problems.append(
                {
                    "shape": shape,
                    "system": system,
                    "variant": name,
                    "stage": "export",
                    "reason": last_error_line(e),
                    "detail": str(e)[-3000:],
                }
            )
            say(f"  failed: {last_error_line(e)}")

    base = work / shape / "exports"
    if "genai" in args.systems:
        src = genai_source(args.genai_ref, work)
        for recipe in args.recipes:
            for name, rargs in GENAI_RECIPES[recipe]:
                if args.variants and name not in args.variants:
                    continue
                for mode in args.modes:
                    out = base / f"genai-{src['key'][:8]}-{name}-{mode}"
                    add(
                        "genai",
                        recipe,
                        f"{name}/{mode}",
                        lambda: export_genai(shape, model, rargs, mode, out, work, args.max_seq_len, src),
                        {"genai_src": src},
                    )
    if "llamacpp" in args.systems:
        inst = installs.get("llamacpp")
        if isinstance(inst, dict) and "python" in inst:
            for recipe in args.recipes:
                for name, ftype in LLAMACPP_RECIPES[recipe]:
                    if args.variants and name not in args.variants:
                        continue
                    add(
                        "llamacpp",
                        recipe,
                        name,
                        lambda: export_llamacpp(model, name, ftype, base / "llamacpp", work, inst, args.threads),
                        {"python": inst["python"]},
                    )
    if "optimum" in args.systems:
        inst = installs.get("optimum")
        if isinstance(inst, dict) and "python" in inst:
            for recipe in args.recipes:
                for name, oargs in OPTIMUM_RECIPES[recipe]:
                    if args.variants and name not in args.variants:
                        continue
                    add(
                        "optimum",
                        recipe,
                        name,
                        lambda: export_optimum(model, oargs, base / f"optimum-{name}", work, inst, args.max_seq_len),
                        {"python": inst["python"], "tokenizer": str(Path(model["folder"]) / "tokenizer.json")},
                    )
    if "ortgenai" in args.systems:
        inst = installs.get("ortgenai")
        if isinstance(inst, dict) and "python" in inst:
            for recipe in args.recipes:
                for name, bargs in ORTGENAI_RECIPES[recipe]:
                    if args.variants and name not in args.variants:
                        continue
                    add(
                        "ortgenai",
                        recipe,
                        name,
                        lambda: export_ortgenai(model, bargs, base / f"ortgenai-{name}", work, inst),
                        {"python": inst["python"]},
                    )
    return variants


installs: dict = {}


def ratio(ours, best):
    return round(ours / best, 2) if ours and best else None


def summarize(rows_in: list[dict], samples: dict) -> list[dict]:
    rows = []
    for v in rows_in:
        got = samples.get(v["id"], [])
        ok = [s for s in got if "error" not in s]
        row = {
            k: v.get(k)
            for k in (
                "shape",
                "system",
                "recipe_class",
                "variant",
                "runner",
                "task",
                "threads",
                "file_mb",
                "export_s",
                "export_peak_rss_mb",
            )
        }
        if ok:
            for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "load_s", "run_peak_rss_mb"):
                row[key] = round(statistics.median(s[key] for s in ok), 1 if key != "load_s" else 3)
            row["prefill_samples"] = [s["prefill_tokens_per_s"] for s in ok]
            row["decode_samples"] = [s["decode_tokens_per_s"] for s in ok]
            row["loadavg_1m_samples"] = [s["loadavg_1m_before"] for s in ok]
            if all("bandwidth_share" in s for s in ok):
                row["bandwidth_share"] = statistics.median(s["bandwidth_share"] for s in ok)
            if "generated_tokens" in ok[0]:
                row["generated_tokens"] = [s["generated_tokens"] for s in ok]
            if "speedup" in ok[0]:
                for key in ("plain_decode_tokens_per_s", "speedup", "tokens_per_call"):
                    row[key] = round(statistics.median(s[key] for s in ok), 3)
                row["tokens"] = [s["tokens"] for s in ok]
                row["first_difference"] = [s["first_difference"] for s in ok]
        errors = [s["error"] for s in got if "error" in s]
        if errors:
            row["run_error"] = errors[0]
        rows.append(row)
    # ours / the best peer row (any system but genai, any runner or thread setting: each peer at its
    # best), within one shape and one recipe class, on the same task (a lookahead row's prompt) or none
    for row in rows:
        if row["system"] != "genai":
            continue
        peers = [
            r
            for r in rows
            if r["system"] != "genai"
            and r["shape"] == row["shape"]
            and r["recipe_class"] == row["recipe_class"]
            and r["task"] == row["task"]
        ]
        ratios = {}
        for key, peer_key, better in (
            ("prefill_tokens_per_s", "prefill_tokens_per_s", max),
            ("decode_tokens_per_s", "decode_tokens_per_s", max),
            ("plain_decode_tokens_per_s", "decode_tokens_per_s", max),  # a lookahead row's
            ("file_mb", "file_mb", min),
            ("export_s", "export_s", min),
            ("export_peak_rss_mb", "export_peak_rss_mb", min),
            ("run_peak_rss_mb", "run_peak_rss_mb", min),
        ):
            vals = [(r[peer_key], r) for r in peers if r.get(peer_key)]
            if vals and row.get(key):
                val, who = better(vals, key=lambda x: x[0])
                ratios[key] = {
                    "ratio": ratio(row[key], val),
                    "best_peer": f"{who['system']} {who['variant']} {who['runner']}",
                }
        row["vs_best_peer"] = ratios
    return rows


def print_table(rows: list[dict], problems: list[dict]) -> None:
    head = (
        f"{'shape':<13} {'system':<9} {'variant':<19} {'runner':<27} {'file MB':>8} {'export s':>8} {'exp RSS':>8} "
        f"{'prefill t/s':>11} {'decode t/s':>10} {'load s':>7} {'run RSS':>8}  {'prefill/best':>12} {'decode/best':>11}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        vs = r.get("vs_best_peer", {})
        fmt = lambda k: f"{vs[k]['ratio']:.2f}" if k in vs and vs[k]["ratio"] is not None else "-"
        num = lambda k, w, p=1: f"{r[k]:>{w}.{p}f}" if r.get(k) is not None else f"{'-':>{w}}"
        print(
            f"{r['shape']:<13} {r['system']:<9} {r['variant']:<19} {r['runner']:<27} {num('file_mb', 8)} {num('export_s', 8)} "
            f"{num('export_peak_rss_mb', 8, 0)} {num('prefill_tokens_per_s', 11)} {num('decode_tokens_per_s', 10)} "
            f"{num('load_s', 7, 2)} {num('run_peak_rss_mb', 8, 0)}  {fmt('prefill_tokens_per_s'):>12} "
            f"{fmt('decode_tokens_per_s'):>11}" + (f"  run failed: {r['run_error'][:80]}" if r.get("run_error") else "")
        )
    print(
        "(ratios: genai / the best peer row of the same shape and recipe class; fp32 ~ F32, 8da8w ~ Q8_0, "
        "8da4w ~ Q4_0 ~ onnxruntime-genai int4)"
    )
    for r in rows:
        for key in ("decode_tokens_per_s", "prefill_tokens_per_s"):
            if key in r.get("vs_best_peer", {}):
                print(
                    f"{r['shape']} genai {r['variant']} {r['runner']}: {key.split('_')[0]} best peer = "
                    f"{r['vs_best_peer'][key]['best_peer']}"
                )
    for r in rows:
        if r.get("speedup") is not None:
            plain = r.get("vs_best_peer", {}).get("plain_decode_tokens_per_s")
            print(
                f"{r['shape']} genai {r['variant']} {r['runner']}: {r['decode_tokens_per_s']} tok/s vs plain {r['plain_decode_tokens_per_s']} "
                f"in the same process ({r['speedup']:.2f}x; plain / best peer on the same prompt: "
                f"{plain['ratio'] if plain else '-'}), {r['tokens_per_call']:.2f} tokens per call, "
                f"first token differing from plain decoding: {r['first_difference']}"
            )
    for r in rows:
        if r.get("bandwidth_share") is not None:
            print(
                f"{r['shape']} genai {r['variant']}: decode reads weights at {100 * r['bandwidth_share']:.0f} % "
                "of the machine's measured copy bandwidth"
            )
    for p in problems:
        print(f"NOT RUN  {p.get('shape', '')} {p['system']} {p.get('variant', '')} [{p['stage']}]: {p['reason']}")


def markdown_table(rows: list[dict], host: dict) -> str:
    """The table in markdown, as the decision records in docs/decisions/ show it."""
    lines = [
        "| shape | system | variant | runner | MB | prefill tok/s | decode tok/s | prefill / best peer | decode / best peer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vs = r.get("vs_best_peer", {})
        ratio_of = lambda k: f"{vs[k]['ratio']:.2f}" if k in vs and vs[k]["ratio"] is not None else ""
        num = lambda k: (
            f"{r[k]:.1f}" if r.get(k) is not None else (r.get("run_error", "")[:40] if k.startswith("decode") else "")
        )
        lines.append(
            f"| {r['shape']} | {r['system']} | {r['variant']} | {r['runner']} | {r.get('file_mb') or ''} | "
            f"{num('prefill_tokens_per_s')} | {num('decode_tokens_per_s')} | {ratio_of('prefill_tokens_per_s')} | "
            f"{ratio_of('decode_tokens_per_s')} |"
        )
    lines.append(
        f"\n{host['cpu_model']}, {host['cpus']} cpus, AMX: {', '.join(host['amx']) or 'none'}; "
        f"load average at start {', '.join(f'{x:.1f}' for x in host['loadavg_start'])}"
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m"], choices=list(SHAPES))
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["genai", "llamacpp", "optimum", "ortgenai"],
        choices=["genai", "llamacpp", "optimum", "ortgenai"],
    )
    parser.add_argument("--recipes", nargs="+", default=["fp32", "8da8w", "8da4w"], choices=list(GENAI_RECIPES))
    parser.add_argument("--modes", nargs="+", default=["dynamic", "hybrid"], help="genai modes")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[],
        help="only these variant names (e.g. 8da4w Q4_0), for any system; default: every one",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--llamacpp-threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="llama.cpp thread settings to try (each with and without flash attention)",
    )
    parser.add_argument(
        "--lookahead",
        type=int,
        nargs="+",
        default=[7],
        help="draft lengths of the lookahead rows (real SmolLM2-135M-Instruct; a program with a `verify` "
        "method of up to N + 1 tokens each); 0: no lookahead rows",
    )
    parser.add_argument("--lookahead-gen-len", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--genai-ref", default="HEAD", help="git ref whose genai_pipeline/ is exported and measured, or 'worktree'"
    )
    parser.add_argument("--skip-install", action="store_true", help="use the venvs under bench/.envs as they are")
    parser.add_argument("--work", default=str(HERE / ".work"))
    parser.add_argument("--json", default=str(HERE / "results" / "compare.json"))
    args = parser.parse_args()
    work = Path(args.work).resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    started = time.time()
    problems: list[dict] = []

    host = machine()
    say(f"{host['cpu_model']}, {host['cpus']} cpus, AMX: {host['amx'] or 'none'}, load average {host['loadavg_start']}")
    for system, install in (
        ("llamacpp", install_llamacpp),
        ("optimum", install_optimum),
        ("ortgenai", install_ortgenai),
    ):
        if system not in args.systems:
            continue
        say(f"install {system}")
        done = ENVS / system / "done.json"
        try:
            if args.skip_install and not done.exists():
                raise ChildFailed(f"--skip-install, and {ENVS / system} has no completed install")
            installs[system] = install(work)
        except ChildFailed as e:
            installs[system] = None
            problems.append(
                {"system": system, "stage": "install", "reason": last_error_line(e), "detail": str(e)[-3000:]}
            )
            say(f"  failed: {last_error_line(e)}")

    variants = []
    for shape in args.shapes:
        variants += prepare_variants(shape, args, work, problems)
    runs = [run for v in variants for run in runs_of(v, args)]
    args.lookahead = [n for n in args.lookahead if n > 0]
    if args.lookahead and "genai" in args.systems and "smollm2-135m" in args.shapes:
        ahead, tasks = lookahead_runs(args, work, problems)
        runs += ahead + [
            run
            for v in variants
            if v["shape"] == "smollm2-135m"
            for task in tasks.items()
            for run in runs_of(v, args, task)
        ]

    samples: dict[str, list] = {}
    measured = time.time()
    for r in range(args.repeats):  # round-robin: every row once per round, so all share the host's moods
        for run in runs:
            try:
                s = measure(run, work)
            except (ChildFailed, ValueError, KeyError) as e:
                s = {"error": last_error_line(e)}
            samples.setdefault(run["id"], []).append(s)
            say(f"round {r + 1}/{args.repeats} {run['id']}: {s}")

    rows = summarize(runs, samples)
    print_table(rows, problems)
    result = {
        "machine": {**host, "loadavg_end": os.getloadavg()},
        "settings": {
            k: getattr(args, k)
            for k in (
                "shapes",
                "systems",
                "recipes",
                "modes",
                "variants",
                "repeats",
                "threads",
                "llamacpp_threads",
                "lookahead",
                "lookahead_gen_len",
                "prompt_len",
                "gen_len",
                "max_seq_len",
                "seed",
                "genai_ref",
            )
        },
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "installs": installs,
        "models": {
            s: json.loads((work / s / "hf" / "done.json").read_text())
            for s in args.shapes
            if (work / s / "hf" / "done.json").exists()
        },
        "rows": rows,
        "samples": samples,
        "not_run": problems,
        "wall_s": round(time.time() - started),
        "measure_s": round(time.time() - measured),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    Path(args.json).with_suffix(".md").write_text(markdown_table(rows, host))
    print(
        f"wrote {args.json} and its table as {Path(args.json).with_suffix('.md').name}; {(time.time() - started) / 60:.1f} min in all, {(time.time() - measured) / 60:.1f} "
        f"of them measuring; load average now {os.getloadavg()}"
    )


if __name__ == "__main__":
    main_or_worker(main, {"_build-model": lambda a: worker_build_model(a[0], a[1], int(a[2]))})
