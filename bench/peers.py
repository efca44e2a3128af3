"""The peers genai is compared with: llama.cpp (llama-cpp-python), optimum-executorch, onnxruntime-genai, and
ExecuTorch's own TextLLMRunner. Each installed in its own venv under bench/.envs (their dependencies stay out of
pyproject.toml), exported, and run by a worker: `python -m bench.peers _run-llamacpp ...` in that venv prints
one JSON line of rates. The method: docs/decisions/0001.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from bench.harness import ENVS, ChildFailed, cached, run_child

LLAMACPP_VERSION = "0.3.36"
OPTIMUM_VERSION = "1.1.0"
# onnxruntime-genai and its model builder (onnxruntime_genai.models.builder), with what the builder imports
ORTGENAI_PINNED = [
    "onnxruntime-genai==0.18.0",
    "onnxruntime==1.31.1",
    "onnx==1.23.2",
    "onnx-ir==1.1.0",
    "onnxscript==0.7.2",
    "torch==2.13.0",
    "transformers>=5,<6",
    "safetensors",
    "numpy",
]
PINNED = ["torch==2.13.0", "executorch==1.5.1", "torchao==0.18.0"]  # the main venv's, for the optimum venv
# llama.cpp built for this CPU, except AMX: on this machine (a Firecracker VM with AMX in its CPUID) ggml's AMX
# matmul segfaults on the first Q4_0 prefill (ggml_backend_amx_mul_mat, 0.3.36), so its AVX-512 VNNI kernels
# and Q4_0 repacking run instead. Explicit -mno-amx-* flags override what -march=native turns on.
LLAMACPP_BUILD = {
    "CMAKE_ARGS": "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF",
    "CFLAGS": "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "CXXFLAGS": "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
}


# ----------------------------------------------------------------------------- installs


def install_llamacpp(work: Path) -> dict:
    env = ENVS / "llamacpp"
    py = env / "bin" / "python"
    src = ENVS / "src"

    def make():
        src.mkdir(parents=True, exist_ok=True)
        log = work / "logs" / "llamacpp-install.log"
        t = time.perf_counter()
        if not py.exists():
            run_child(["python3", "-m", "venv", env])
        sdist = src / f"llama_cpp_python-{LLAMACPP_VERSION}.tar.gz"
        if not sdist.exists():  # the sdist carries llama.cpp, its converter and gguf-py: PyPI only
            run_child(
                [
                    py,
                    "-m",
                    "pip",
                    "download",
                    "--no-binary",
                    ":all:",
                    "--no-deps",
                    f"llama-cpp-python=={LLAMACPP_VERSION}",
                    "-d",
                    src,
                ],
                log=log,
            )
        tree = src / f"llama_cpp_python-{LLAMACPP_VERSION}"
        if not tree.exists():
            with tarfile.open(sdist) as tar:
                tar.extractall(src, filter="data")
        have = subprocess.run(
            [py, "-c", "import llama_cpp; print(llama_cpp.__version__)"], capture_output=True, text=True
        )
        flags = env / "build-flags.json"  # a finished build in this venv with the same flags is kept
        built = (
            have.stdout.strip() == LLAMACPP_VERSION
            and flags.exists()
            and json.loads(flags.read_text()) == LLAMACPP_BUILD
        )
        run_child(
            [
                py,
                "-m",
                "pip",
                "install",
                *([] if built else ["--force-reinstall", "--no-deps", "--no-cache-dir", sdist]),
            ],
            log=log,
            env={**LLAMACPP_BUILD, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count())},
        )
        flags.write_text(json.dumps(LLAMACPP_BUILD))
        run_child(
            [
                py,
                "-m",
                "pip",
                "install",
                "llama-cpp-python==" + LLAMACPP_VERSION,
                "gguf",
                "numpy",
                "torch==2.13.0",
                "transformers>=5",
                "safetensors",
                "sentencepiece",
            ],
            log=log,
        )
        _, _, version = run_child([py, "-c", "import llama_cpp; print(llama_cpp.__version__)"])
        return {
            "python": str(py),
            "llama_cpp_python": version.strip(),
            "llama_cpp_tree": str(tree / "vendor" / "llama.cpp"),
            "build": LLAMACPP_BUILD,
            "install_s": round(time.perf_counter() - t),
        }

    return cached(env / "done.json", make)


def pip_venv(name: str, work: Path, requirements: list[str], report: tuple[str, ...]) -> dict:
    """A venv under bench/.envs with `requirements` pip-installed (a no-op when they are there), and
    the versions of the `report` packages."""
    env = ENVS / name
    py = env / "bin" / "python"

    def make():
        t = time.perf_counter()
        if not py.exists():
            run_child(["python3", "-m", "venv", env])
        run_child([py, "-m", "pip", "install", *requirements], log=work / "logs" / f"{name}-install.log")
        _, _, out = run_child(
            [
                py,
                "-c",
                "import importlib.metadata as m; import json, sys; "
                "print(json.dumps({p: m.version(p) for p in sys.argv[1:]}))",
                *report,
            ]
        )
        return {"python": str(py), "versions": json.loads(out), "install_s": round(time.perf_counter() - t)}

    return cached(env / "done.json", make)


def install_optimum(work: Path) -> dict:
    return pip_venv(
        "optimum",
        work,
        [f"optimum-executorch=={OPTIMUM_VERSION}", *PINNED],
        ("optimum-executorch", "optimum", "executorch", "torch", "torchao", "transformers"),
    )


def install_ortgenai(work: Path) -> dict:
    return pip_venv(
        "ortgenai", work, ORTGENAI_PINNED, ("onnxruntime-genai", "onnxruntime", "onnx", "torch", "transformers")
    )


# ----------------------------------------------------------------------------- exports


def worker_convert_gguf(tree: str, hf: str, outfile: str) -> None:
    """Runs in the llama.cpp venv: the sdist's convert_hf_to_gguf.py on our folder, F32.

    Our tokenizer is ours, so the converter's table of known BPE pre-tokenizers (a hash of how
    the tokenizer splits a test text) cannot know it: we tell it the pre-tokenizer is GPT-2's
    byte-level split, which it is. Token ids are all the benchmark uses."""
    sys.path.insert(0, tree)
    sys.path.insert(1, str(Path(tree) / "gguf-py"))
    import conversion.base as base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = ["convert_hf_to_gguf.py", hf, "--outtype", "f32", "--outfile", outfile]
    import runpy

    runpy.run_path(str(Path(tree) / "convert_hf_to_gguf.py"), run_name="__main__")


def worker_quantize(src: str, dst: str, ftype: int, threads: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    params.allow_requantize = True  # a GGUF checkpoint's own quantized tensors, dequantized to F32 (src F32: no-op)
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")


def export_llamacpp(model, name, ftype, out: Path, work: Path, inst: dict, threads: int) -> dict:
    f32 = out / "model-F32.gguf"
    target = out / f"model-{name}.gguf"

    def make():
        out.mkdir(parents=True, exist_ok=True)
        f32_log = work / "logs" / f"{out.parent.parent.name}-gguf-F32.log"
        if ftype is None and "gguf" in model:  # a GGUF checkpoint: its tensors dequantized, as genai reads them
            wall, rss, _ = run_child(
                [inst["python"], "-m", "bench.peers", "_quantize", model["gguf"], f32, "0", str(threads)], log=f32_log
            )
            what = "llama_model_quantize(ftype=0: ALL_F32, allow_requantize) of the GGUF"
        elif ftype is None:
            wall, rss, _ = run_child(
                [inst["python"], "-m", "bench.peers", "_convert-gguf", inst["llama_cpp_tree"], model["folder"], f32],
                log=f32_log,
            )
            what = "convert_hf_to_gguf.py --outtype f32"
        else:
            base = export_llamacpp(model, "F32", None, out, work, inst, threads)
            wall, rss, _ = run_child(
                [inst["python"], "-m", "bench.peers", "_quantize", f32, target, str(ftype), str(threads)],
                log=work / "logs" / f"{out.parent.parent.name}-gguf-{name}.log",
            )
            what = f"{base['how']} ({base['export_s']} s) + llama_model_quantize(ftype={ftype}) ({wall:.1f} s)"
            # the whole path from the checkpoint, as for the other systems
            return {
                "file": str(target),
                "export_s": round(base["export_s"] + wall, 1),
                "quantize_s": round(wall, 1),
                "export_peak_rss_mb": max(base["export_peak_rss_mb"], round(rss)),
                "how": what,
            }
        return {"file": str(target), "export_s": round(wall, 1), "export_peak_rss_mb": round(rss), "how": what}

    return cached(out / f"{name}.done.json", make)


def export_optimum(model, args, out: Path, work: Path, inst: dict, max_seq_len: int) -> dict:
    def make():
        cli = Path(inst["python"]).parent / "optimum-cli"
        argv = [
            cli,
            "export",
            "executorch",
            "--model",
            model["folder"],
            "--task",
            "text-generation",
            "--recipe",
            "xnnpack",
            "--use_custom_sdpa",
            "--use_custom_kv_cache",
            "--max_seq_len",
            str(max_seq_len),
            *args,
            "--output_dir",
            out,
        ]
        wall, rss, _ = run_child(argv, log=work / "logs" / f"{out.parent.parent.name}-{out.name}-export.log")
        ptes = sorted(out.glob("*.pte"))
        if not ptes:
            raise ChildFailed(f"no .pte in {out}")
        return {
            "file": str(ptes[0]),
            "export_s": round(wall, 1),
            "export_peak_rss_mb": round(rss),
            "command": " ".join(map(str, argv)),
        }

    return cached(out / "done.json", make)


def export_ortgenai(model, args, out: Path, work: Path, inst: dict) -> dict:
    def make():
        argv = [
            inst["python"],
            "-m",
            "onnxruntime_genai.models.builder",
            "-i",
            model["folder"],
            "-o",
            out,
            "-e",
            "cpu",
            "-c",
            out.parent / f"{out.name}-cache",
            *args,
        ]
        wall, rss, _ = run_child(
            argv, log=work / "logs" / f"{out.parent.parent.name}-{out.name}-export.log", env={"HF_HUB_OFFLINE": "1"}
        )
        onnx = out / "model.onnx"
        if not onnx.exists():
            raise ChildFailed(f"no model.onnx in {out}")
        # what a decode step reads: the graph and its external weights
        mb = sum(f.stat().st_size for f in out.iterdir() if f.name.startswith("model.onnx"))
        return {
            "file": str(onnx),
            "export_s": round(wall, 1),
            "export_peak_rss_mb": round(rss),
            "weights_mb": round(mb / 2**20, 1),
            "command": " ".join(map(str, argv)),
        }

    return cached(out / "done.json", make)


# ----------------------------------------------------------------------------- runs


def prompt_ids(vocab: int, prompt: str) -> list[int]:
    """`prompt`: a count of seeded random ids (as genai bench draws them), or a JSON file of a task's ids."""
    if not prompt.isdigit():
        return json.loads(Path(prompt).read_text())
    import torch

    return torch.randint(1, vocab, (int(prompt),), generator=torch.Generator().manual_seed(0)).tolist()


def timed_rounds(prefill, step, reset, prompt: list[int], gen_len: int) -> dict:
    """One warm-up round then one timed round; rates of the timed one."""
    for _ in range(2):
        reset()
        t = time.perf_counter()
        token = prefill(prompt)
        prefill_rate = len(prompt) / (time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(gen_len):
            token = step(token)
        decode_rate = gen_len / (time.perf_counter() - t)
    return {"prefill_tokens_per_s": round(prefill_rate, 1), "decode_tokens_per_s": round(decode_rate, 1)}


def worker_run_llamacpp(path: str, vocab: int, prompt: str, gen_len: int, threads: int, flash_attn: bool) -> None:
    import numpy as np
    from llama_cpp import Llama

    ids = prompt_ids(vocab, prompt)
    t = time.perf_counter()
    llm = Llama(
        model_path=path,
        n_ctx=len(ids) + gen_len + 8,
        n_batch=512,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=flash_attn,
        verbose=False,
    )
    load_s = time.perf_counter() - t

    n_vocab = llm.n_vocab()

    def last_logits():  # only the last token of a batch has logits (logits_all=False)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))

    def prefill(ids):
        llm.eval(ids)
        return int(np.argmax(last_logits()))

    def step(token):
        llm.eval([token])
        return int(np.argmax(last_logits()))

    rates = timed_rounds(prefill, step, llm.reset, ids, gen_len)
    print(json.dumps({"load_s": round(load_s, 3), **rates}))


def worker_run_optimum(path: str, vocab: int, prompt: str, gen_len: int, threads: int) -> None:
    import torch
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  custom SDPA and KV-cache update kernels
    from executorch.extension.pybindings import portable_lib
    from executorch.kernels import quantized  # noqa: F401  the quantized ops' kernels, as optimum's runner loads them

    portable_lib._unsafe_reset_threadpool(threads)
    t = time.perf_counter()
    module = portable_lib._load_for_executorch(path)
    module.run_method("forward", (torch.tensor([[1]], dtype=torch.long), torch.tensor([0], dtype=torch.long)))
    load_s = time.perf_counter() - t  # includes one 1-token call: methods load lazily
    pos = [0]

    def forward(ids):
        n = len(ids)
        tokens = torch.tensor([ids], dtype=torch.long)
        cache_position = torch.arange(pos[0], pos[0] + n, dtype=torch.long)
        logits = module.run_method("forward", (tokens, cache_position))[0]
        pos[0] += n
        return int(logits.reshape(-1, logits.shape[-1])[-1].argmax())

    def reset():  # the KV cache is overwritten from position 0 on; attention is masked by position
        pos[0] = 0

    rates = timed_rounds(forward, lambda token: forward([token]), reset, prompt_ids(vocab, prompt), gen_len)
    print(json.dumps({"load_s": round(load_s, 3), **rates}))


def prompt_text(tokenizer_json: str, n: int) -> str:
    """Prose that the model's tokenizer makes `n` tokens of, for runners that take text (ExecuTorch's
    TextLLMRunner): the first n tokens of Python's own topic help, decoded."""
    import pydoc_data.topics

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    ids = tok.encode(" ".join(pydoc_data.topics.topics.values())).ids
    for m in range(n, n + 16):  # a cut between two tokens that merge again: take one more
        text = tok.decode(ids[:m])
        if len(tok.encode(text).ids) == n:
            return text
    raise SystemExit(f"no {n}-token prompt text for {tokenizer_json}")


def worker_run_textllm(path: str, tokenizer_json: str, prompt_len: int, gen_len: int, threads: int) -> None:
    """ExecuTorch's own C++ LLM runner (`executorch.extension.llm.runner.TextLLMRunner`), as optimum-executorch's
    and ExecuTorch's users run a program: tokenizer, prefill, decode loop and sampling in C++. Rates come from
    the runner's own stats (milliseconds), as its own report computes them: prefill = prompt tokens / (prompt
    evaluated - inference start); decode = generated / (end - prompt evaluated), where `generated` counts the
    decode steps' tokens only (max_new_tokens = gen_len + 1: the first token comes from prefill)."""
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  custom SDPA and KV-cache update kernels
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner
    from executorch.extension.pybindings import portable_lib
    from executorch.kernels import quantized  # noqa: F401  the quantized ops' kernels

    text = prompt_text(tokenizer_json, prompt_len)
    out = os.dup(1)  # the runner prints the tokens it generates to stdout; the result line is ours
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    portable_lib._unsafe_reset_threadpool(threads)
    runner = TextLLMRunner(path, tokenizer_json)
    stats = []
    for warming in (True, False):
        runner.reset()
        stats.clear()
        runner.generate(
            text,
            GenerationConfig(echo=False, max_new_tokens=gen_len + 1, temperature=0.0, warming=warming),
            stats_callback=stats.append,
        )
    s = stats[-1]
    result = {
        "load_s": round((s.model_load_end_ms - s.model_load_start_ms) / 1000, 3),
        "prompt_tokens": s.num_prompt_tokens,
        "generated_tokens": s.num_generated_tokens,
        "prefill_tokens_per_s": round(
            1000 * s.num_prompt_tokens / max(1, s.prompt_eval_end_ms - s.inference_start_ms), 1
        ),
        "decode_tokens_per_s": round(
            1000 * s.num_generated_tokens / max(1, s.inference_end_ms - s.prompt_eval_end_ms), 1
        ),
    }
    os.write(out, (json.dumps(result) + "\n").encode())


def worker_run_ortgenai(folder: str, vocab: int, prompt: str, gen_len: int, threads: int) -> None:
    """onnxruntime-genai's generator loop: append_tokens runs the prompt, each generate_next_token after
    the first (which samples prefill's logits) runs one decode step; greedy, EOS held off by min_length."""
    config_path = Path(folder) / "genai_config.json"
    config = json.loads(config_path.read_text())
    session = config["model"]["decoder"].setdefault("session_options", {})
    if session.get("intra_op_num_threads") != threads:  # threads are a session option of the config file
        session["intra_op_num_threads"] = threads
        config_path.write_text(json.dumps(config, indent=4))
    import onnxruntime_genai as og

    t = time.perf_counter()
    model = og.Model(folder)
    load_s = time.perf_counter() - t
    ids = prompt_ids(vocab, prompt)
    total = len(ids) + gen_len + 1
    for _ in range(2):  # a warm-up round, then the timed one
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        generator = og.Generator(model, params)
        t = time.perf_counter()
        generator.append_tokens(ids)
        generator.generate_next_token()  # samples prefill's logits: the first token
        prefill_rate = len(ids) / (time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(gen_len):
            generator.generate_next_token()
        decode_rate = gen_len / (time.perf_counter() - t)
        del generator
    print(
        json.dumps(
            {
                "load_s": round(load_s, 3),
                "prefill_tokens_per_s": round(prefill_rate, 1),
                "decode_tokens_per_s": round(decode_rate, 1),
            }
        )
    )


WORKERS = {
    "_convert-gguf": lambda a: worker_convert_gguf(a[0], a[1], a[2]),
    "_quantize": lambda a: worker_quantize(a[0], a[1], int(a[2]), int(a[3])),
    "_run-llamacpp": lambda a: worker_run_llamacpp(a[0], int(a[1]), a[2], int(a[3]), int(a[4]), bool(int(a[5]))),
    "_run-textllm": lambda a: worker_run_textllm(a[0], a[1], int(a[2]), int(a[3]), int(a[4])),
    "_run-ortgenai": lambda a: worker_run_ortgenai(a[0], int(a[1]), a[2], int(a[3]), int(a[4])),
    "_run-optimum": lambda a: worker_run_optimum(a[0], int(a[1]), a[2], int(a[3]), int(a[4])),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peers", description="One peer's worker, as bench.compare and bench.accuracy start it"
    )
    parser.add_argument("worker", choices=list(WORKERS))
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    WORKERS[args.worker](args.args)


if __name__ == "__main__":
    main()
