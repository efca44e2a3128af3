"""Vision-language models side by side: genai vs optimum-executorch vs llama.cpp's mtmd, one SmolVLM-256M-shaped
random model, one 512 x 512 image.

A benchmark, not a test; the text-model comparison is compare.py, whose peers' venvs (bench/peers.py) this
script uses. Stages, each cached in `--work` (a re-run resumes and only measures again):

  model      a transformers `SmolVLMForConditionalGeneration` folder with SmolVLM-256M's shapes (text 576 wide,
             MLP 1536, 30 layers, 9 heads / 3 KV heads, vocabulary 49280, untied head; SigLIP 768 wide, 12 layers,
             patch 16, 512 px; pixel shuffle by 4: 64 tokens per frame), seeded random weights (std 0.02, norms 1).
             Tokenizer: SmolLM2's byte-level BPE (49152 entries, read from the SmolLM2-135M-Instruct GGUF in .cache,
             the vocabulary SmolVLM's tokenizer extends) plus SmolVLM's added tokens at SmolVLM's ids
             (`<global-img>` 49152, `<row_r_col_c>` 49153-49188, `<fake_token_around_image>` 49189, `<image>` 49190,
             `<end_of_utterance>` 49279, reserved names between), SmolVLM's chat template, processor files with
             splitting off (one image = one 512 px frame = 64 `<image>` tokens; tiles are more frames of the same).
  exports    genai: `genai export --checkpoint` (fp32; 8da4w decoder + 8da8w vision); optimum-executorch:
             `optimum-cli export executorch --task image-text-to-text` (xnnpack, custom SDPA + KV cache; fp32 and
             `--qlinear 8da4w --qlinear_encoder 8da8w`); llama.cpp: the sdist's convert_hf_to_gguf.py for the text
             model (F32, then llama_model_quantize Q4_0) and with `--mmproj` for the image tower + projector (F32,
             Q8_0).
  runs       each in a child, round-robin over variants, `--repeats` rounds, medians; the 1-minute load average
             before each sample is recorded. Per run: one warm-up pass, then one timed pass of: encode the image,
             prefill the prompt with the image's embeddings spliced in, first token (TTFT = all of that), then
             `--gen-len` greedy decode steps.
             genai: `genai_pipeline.runtime.multimodal.MultimodalSession` (what `genai run --image` uses);
             encode ms = its vision_encoder call. optimum: its program's three methods called as ExecuTorch's
             MultimodalRunner calls them (token_embedding, vision_encoder, text_decoder with cache positions).
             llama.cpp: `llama-mtmd-cli` built from the same sdist's llama.cpp (cmake, same flags as compare.py's
             llama-cpp-python build: native, no AMX): its per-frame encode times, TTFT and decode rate from when
             its output arrives (see run_mtmd). ExecuTorch programs also run once in ExecuTorch's own
             MultimodalRunner, as a check.

    .venv/bin/python -m bench.compare_vlm [--systems genai optimum llamacpp] [--recipes fp32 8da4w]
        [--repeats 3] [--threads 2] [--llamacpp-threads N] [--gen-len 64] [--exports-only] [--no-runner-check]

Writes bench/results/compare_vlm.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
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
from bench.peers import LLAMACPP_BUILD, LLAMACPP_VERSION

GGUF_VOCAB = ROOT / ".cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # SmolLM2's tokenizer, which SmolVLM's extends
MTMD = ENVS / "llamacpp-mtmd"
LLAMA_TREE = ENVS / "src" / f"llama_cpp_python-{LLAMACPP_VERSION}" / "vendor" / "llama.cpp"

IMAGE = 512
TOKENS_PER_IMAGE = 64
TEXT = dict(
    model_type="llama",
    vocab_size=49280,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    bos_token_id=1,
    eos_token_id=49279,
    pad_token_id=2,
)
VISION = dict(
    model_type="smolvlm_vision",
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    patch_size=16,
    image_size=IMAGE,
    hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6,
)
SPECIAL = {"<global-img>": 49152, "<fake_token_around_image>": 49189, "<image>": 49190, "<end_of_utterance>": 49279}
CHAT_TEMPLATE = (  # SmolVLM's (transformers' processing_smolvlm DEFAULT_CHAT_TEMPLATE, images and text only)
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'] is string %}"
    "{{': ' + message['content']}}{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}"
    "{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
QUESTION = "Describe this image in detail."

# recipe class -> variants per system
# The 8da4w decoder's GPTQ calibrates on assets/reference/sample.txt by default; genai runs from a snapshot of
# genai_pipeline/ only, so the same file is named explicitly.
GENAI_RECIPES = {
    "fp32": [("fp32", ["--recipe", "fp32"])],
    "8da4w": [
        (
            "8da4w+vision8da8w",
            [
                "--recipe",
                "8da4w",
                "--vision-recipe",
                "8da8w",
                "--calib",
                f"text:{ROOT / 'assets' / 'reference' / 'sample.txt'}",
            ],
        )
    ],
}
OPTIMUM_RECIPES = {
    "fp32": [("fp32", [])],
    "8da4w": [("8da4w+vision8da8w", ["--qlinear", "8da4w", "--qlinear_encoder", "8da8w"])],
}
LLAMACPP_RECIPES = {"fp32": [("F32+mmproj-F32", (None, "f32"))], "8da4w": [("Q4_0+mmproj-Q8_0", (2, "q8_0"))]}
MTMD_BUILD = {
    **LLAMACPP_BUILD,
    "CMAKE_ARGS": "-DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF "
    "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF "
    "-DMTMD_VIDEO=OFF -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_TYPE=Release",
}


# ----------------------------------------------------------------------------- stage 1: model and image


def worker_build_model(out: str, seed: int) -> None:
    """Runs in the main venv: the random-weight SmolVLM folder, its tokenizer and processor files."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from genai_pipeline.checkpoints.gguf import open_reader
    from genai_pipeline.checkpoints.gguf_vocab import tokenizer_files

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = transformers.SmolVLMConfig(
        text_config=TEXT,
        vision_config=VISION,
        scale_factor=4,
        image_token_id=SPECIAL["<image>"],
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=SPECIAL["<end_of_utterance>"],
        pad_token_id=2,
    )
    config.architectures = ["SmolVLMForConditionalGeneration"]
    # as SmolVLM's own config.json has it: llama.cpp's converter picks the text model's class by this name
    config.text_config.architectures = ["VLlama3ForCausalLM"]
    torch.manual_seed(seed)
    with torch.no_grad():
        model = transformers.SmolVLMForConditionalGeneration(config).float().eval()
        for name, p in model.named_parameters():  # std 0.02 for every matrix, 1 / 0 for norms' weights / biases
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif "norm" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True)

    text, _, _ = tokenizer_files(open_reader(GGUF_VOCAB), GGUF_VOCAB)
    tok = Tokenizer.from_str(text)
    base = tok.get_vocab_size()
    assert base == SPECIAL["<global-img>"], base
    names = {i: t for t, i in SPECIAL.items()}
    names.update({49153 + 6 * r + c: f"<row_{r + 1}_col_{c + 1}>" for r in range(6) for c in range(6)})
    added = [names.get(i, f"<|reserved_special_token_{i - 49191}|>") for i in range(base, TEXT["vocab_size"])]
    tok.add_special_tokens(added)
    assert all(tok.token_to_id(t) == i for t, i in SPECIAL.items()) and tok.get_vocab_size() == TEXT["vocab_size"]
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|im_start|>",
                "eos_token": "<end_of_utterance>",
                "pad_token": "<|im_end|>",
                "unk_token": "<|endoftext|>",
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": 8192,
                "chat_template": CHAT_TEMPLATE,
                "extra_special_tokens": {
                    "image_token": "<image>",
                    "fake_image_token": "<fake_token_around_image>",
                    "global_image_token": "<global-img>",
                    "end_of_utterance_token": "<end_of_utterance>",
                },
            },
            indent=2,
        )
        + "\n"
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Idefics3ImageProcessor",
                "do_convert_rgb": True,
                "do_resize": True,
                "size": {"longest_edge": IMAGE},
                "max_image_size": {"longest_edge": IMAGE},
                "do_image_splitting": False,
                "resample": 1,
                "do_rescale": True,
                "rescale_factor": 1 / 255,
                "do_normalize": True,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "do_pad": True,
            },
            indent=2,
        )
        + "\n"
    )
    (out / "processor_config.json").write_text(
        json.dumps({"image_seq_len": TOKENS_PER_IMAGE, "processor_class": "Idefics3Processor"}, indent=2) + "\n"
    )

    # The benchmark's image: 512 x 512, seeded (smooth gradients + noise), PNG for every system.
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:IMAGE, 0:IMAGE] / IMAGE
    rgb = np.stack([x, y, (x + y) / 2], -1) * 200 + rng.normal(0, 20, (IMAGE, IMAGE, 3))
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(out / "image.png")


def build_model(work: Path, seed: int) -> dict:
    folder = work / "smolvlm-256m" / "hf"

    def make():
        wall, rss, _ = run_child(
            [MAIN_PY, "-m", "bench.compare_vlm", "_build-model", folder, str(seed)],
            log=work / "logs" / "smolvlm-build-model.log",
        )
        n = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        return {
            "folder": str(folder),
            "image": str(folder / "image.png"),
            "seed": seed,
            "build_s": round(wall, 1),
            "safetensors_mb": round(n / 2**20, 1),
        }

    return cached(folder / "done.json", make)


# ----------------------------------------------------------------------------- stage 2: exports


def export_genai(model: dict, name: str, recipe_args: list, out: Path, work: Path, max_seq_len: int, src: dict) -> dict:
    def make():
        argv = [
            MAIN_PY,
            "-m",
            "genai_pipeline.cli",
            "export",
            "--checkpoint",
            model["folder"],
            *recipe_args,
            "--max-seq-len",
            str(max_seq_len),
            "--out",
            out,
        ]
        wall, rss, _ = run_child(argv, log=work / "logs" / f"genai-{name}-export.log", cwd=src["cwd"], env=src["env"])
        return {
            "file": str(out / "multimodal.pte"),
            "export_s": round(wall, 1),
            "export_peak_rss_mb": round(rss),
            "genai_sha": src["sha"],
            "command": " ".join(map(str, argv[1:])),
        }

    return cached(out / "done.json", make)


def worker_export_optimum(argv: list) -> None:
    """Runs in the optimum venv: `optimum-cli export executorch` with one change. Its vision encoder's example
    input comes from `VisionExportableModule.prepare_export_inputs`, which asks the model's processor for a chat
    with an image at https://llava-vl.github.io/static/images/view.jpg: a download (none here) and Pillow (not in
    that venv). It is replaced by what that processor returns for one unsplit 512 px image: float pixel_values
    [1, 1, 3, 512, 512] (the shape is all torch.export keeps; the benchmark feeds the same shape)."""
    import torch
    from optimum.exporters.executorch import integrations

    def local_inputs(self):
        return torch.rand(
            1, 1, 3, IMAGE, IMAGE, dtype=self.model.dtype, generator=torch.Generator().manual_seed(0)
        ), None

    integrations.VisionExportableModule.prepare_export_inputs = local_inputs
    from optimum.commands.optimum_cli import main

    sys.argv = ["optimum-cli", *argv]
    main()


def idefics3_folder(model: dict) -> Path:
    """The same weights under `model_type` idefics3 (`Idefics3ForConditionalGeneration`, the architecture
    SmolVLM-256M is built on): optimum-executorch loads multimodal models through AutoModelForPreTraining, which in its
    transformers (5.0.0rc1) maps idefics3 but not smolvlm. Files are links; only config.json differs."""
    src, dst = Path(model["folder"]), Path(model["folder"]).parent / "hf-idefics3"
    if not (dst / "config.json").exists():
        dst.mkdir(exist_ok=True)
        for f in src.iterdir():
            if f.name not in ("config.json", "done.json") and not (dst / f.name).exists():
                (dst / f.name).symlink_to(f)
        config = json.loads((src / "config.json").read_text())
        config.update(model_type="idefics3", architectures=["Idefics3ForConditionalGeneration"])
        config["vision_config"]["model_type"] = "idefics3_vision"
        (dst / "config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
        (dst / "config.json.tmp").rename(dst / "config.json")
    return dst


def probe_optimum_smolvlm(model: dict, work: Path, inst: dict, problems: list) -> None:
    """Whether optimum-executorch takes the folder as it is (`model_type` smolvlm); the answer is cached."""

    def make():
        code = (
            "import transformers as t; "
            f"t.AutoModelForPreTraining.from_config(t.AutoConfig.from_pretrained({model['folder']!r}))"
        )
        try:
            run_child([inst["python"], "-c", code], log=work / "logs" / "optimum-smolvlm-probe.log")
            return {"loads": True}
        except ChildFailed as e:
            return {"loads": False, "reason": last_error_line(e)}

    got = cached(work / "smolvlm-256m" / "optimum-smolvlm-probe.json", make)
    if not got["loads"]:
        problems.append(
            {
                "system": "optimum",
                "variant": "model_type smolvlm",
                "stage": "export",
                "reason": "optimum-executorch loads multimodal models with AutoModelForPreTraining: "
                + got["reason"][:160]
                + " -- exported from the same weights as idefics3 instead",
            }
        )


def export_error(log: Path) -> str | None:
    """The exception a failed export ended with and, for torch.export's, the line of model code it names."""
    lines = log.read_text(errors="replace").splitlines()
    errors = [l.strip() for l in lines if re.match(r"^[\w.]+(Error|Exception): ", l)]
    caused = [l.strip() for l in lines if l.startswith("Caused by:")]
    return " ".join([*errors[-1:], *caused[-1:]])[:600] or None


def export_optimum(model: dict, name: str, args: list, out: Path, work: Path, inst: dict, max_seq_len: int) -> dict:
    def make():
        argv = [
            "export",
            "executorch",
            "--model",
            idefics3_folder(model),
            "--task",
            "image-text-to-text",
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
        try:
            wall, rss, _ = run_child(
                [inst["python"], "-m", "bench.compare_vlm", "_export-optimum", *argv],
                log=work / "logs" / f"optimum-{name}-export.log",
            )
        except (
            ChildFailed
        ) as e:  # deterministic (same code, same model): kept, so a re-run does not spend minutes on it
            if e.args[0].startswith("exit -"):  # a signal, not optimum's answer
                raise
            return {
                "failed": export_error(work / "logs" / f"optimum-{name}-export.log") or last_error_line(e),
                "detail": str(e)[-3000:],
                "command": "optimum-cli " + " ".join(map(str, argv)),
            }
        ptes = sorted(out.glob("*.pte"))
        if not ptes:
            raise ChildFailed(f"no .pte in {out}")
        return {
            "file": str(ptes[0]),
            "export_s": round(wall, 1),
            "export_peak_rss_mb": round(rss),
            "command": "optimum-cli "
            + " ".join(map(str, argv))
            + " (sample image input replaced: see worker_export_optimum)",
        }

    return cached(out / "done.json", make)


def worker_convert_gguf(tree: str, hf: str, outfile: str, outtype: str, mmproj: str) -> None:
    """Runs in the llama.cpp venv: the sdist's convert_hf_to_gguf.py, the text model or (`mmproj` = 1) the
    image tower + projector."""
    sys.path.insert(0, tree)
    sys.path.insert(1, str(Path(tree) / "gguf-py"))
    import runpy

    sys.argv = [
        "convert_hf_to_gguf.py",
        hf,
        "--outtype",
        outtype,
        "--outfile",
        outfile,
        *(["--mmproj"] if mmproj == "1" else []),
    ]
    runpy.run_path(str(Path(tree) / "convert_hf_to_gguf.py"), run_name="__main__")


def export_llamacpp(model: dict, name: str, recipe: tuple, out: Path, work: Path, inst: dict, threads: int) -> dict:
    """A text GGUF (F32, or F32 then llama_model_quantize) and an mmproj GGUF; export_s is the whole path."""
    ftype, mmproj_type = recipe

    def convert(outfile: Path, outtype: str, mmproj: bool) -> dict:
        def make():
            wall, rss, _ = run_child(
                [
                    inst["python"],
                    "-m",
                    "bench.compare_vlm",
                    "_convert-gguf",
                    LLAMA_TREE,
                    model["folder"],
                    outfile,
                    outtype,
                    "1" if mmproj else "0",
                ],
                log=work / "logs" / f"llamacpp-{outfile.stem}.log",
            )
            return {"file": str(outfile), "export_s": round(wall, 1), "export_peak_rss_mb": round(rss)}

        return cached(outfile.with_suffix(".done.json"), make)

    out.mkdir(parents=True, exist_ok=True)
    text = convert(out / "text-F32.gguf", "f32", False)
    proj = convert(out / f"mmproj-{mmproj_type.upper()}.gguf", mmproj_type, True)
    steps = [text, proj]
    if ftype is not None:
        target = out / f"text-{name.split('+')[0]}.gguf"

        def make():
            wall, rss, _ = run_child(
                [inst["python"], "-m", "bench.peers", "_quantize", text["file"], target, str(ftype), str(threads)],
                log=work / "logs" / f"llamacpp-{target.stem}.log",
            )
            return {"file": str(target), "export_s": round(wall, 1), "export_peak_rss_mb": round(rss)}

        steps.append(cached(target.with_suffix(".done.json"), make))
    text_file = steps[-1]["file"] if ftype is not None else text["file"]
    size = Path(text_file).stat().st_size + Path(proj["file"]).stat().st_size
    return {
        "file": text_file,
        "mmproj": proj["file"],
        "bytes": size,
        "export_s": round(sum(s["export_s"] for s in steps), 1),
        "export_peak_rss_mb": max(s["export_peak_rss_mb"] for s in steps),
        "how": "convert_hf_to_gguf.py --outtype f32"
        + (f" + llama_model_quantize(ftype={ftype})" if ftype else "")
        + f"; convert_hf_to_gguf.py --mmproj --outtype {mmproj_type}",
    }


def build_mtmd(work: Path) -> dict:
    """llama-mtmd-cli from the llama-cpp-python sdist's llama.cpp (the sdist compare.py installs), built with cmake
    into bench/.envs/llamacpp-mtmd: llama-cpp-python 0.3.36 ships mtmd bindings (mtmd_cpp.py) but compare.py
    builds it with -DLLAVA_BUILD=OFF, so its wheel has no libmtmd."""
    binary = MTMD / "build" / "bin" / "llama-mtmd-cli"

    def make():
        if not LLAMA_TREE.exists():
            raise ChildFailed(f"{LLAMA_TREE} is missing: run `python -m bench.compare --systems llamacpp` first")
        log = work / "logs" / "llamacpp-mtmd-build.log"
        t = time.perf_counter()
        env = {k: v for k, v in MTMD_BUILD.items() if k != "CMAKE_ARGS"}
        run_child(
            ["cmake", "-S", LLAMA_TREE, "-B", MTMD / "build", "-G", "Ninja", *MTMD_BUILD["CMAKE_ARGS"].split()],
            log=log,
            env=env,
        )
        run_child(
            ["cmake", "--build", MTMD / "build", "--target", "llama-mtmd-cli", "-j", str(os.cpu_count())],
            log=log,
            env=env,
        )
        return {"binary": str(binary), "build": MTMD_BUILD, "build_s": round(time.perf_counter() - t)}

    done = MTMD / "done.json"
    if not done.exists() and binary.exists():  # built by hand with these flags before the stage existed
        done.write_text(json.dumps({"binary": str(binary), "build": MTMD_BUILD, "build_s": None}, indent=2) + "\n")
    return cached(done, make)


# ----------------------------------------------------------------------------- stage 3: measurements


def worker_prompt(hf: str, out: str) -> None:
    """Main venv: the prompt as transformers' processor makes it (chat template, image expanded) and its
    pixel_values, the inputs every ExecuTorch program gets."""
    import torch
    import transformers
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(hf)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    batch = processor(text=text, images=[Image.open(Path(hf) / "image.png")], return_tensors="pt")
    torch.save({"text": text, "ids": batch["input_ids"][0].tolist(), "pixel_values": batch["pixel_values"]}, out)


def timed_pass(prefill, step, reset, gen_len: int) -> dict:
    """One warm-up pass then one timed pass: TTFT (encode + prefill + first token), then `gen_len` decode steps."""
    for _ in range(2):
        reset()
        t = time.perf_counter()
        token, encode_s = prefill()
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(gen_len):
            token = step(token)
        decode = gen_len / (time.perf_counter() - t)
    return {
        "encode_ms": round(encode_s * 1e3, 1),
        "ttft_ms": round(ttft * 1e3, 1),
        "decode_tokens_per_s": round(decode, 1),
    }


def worker_run_genai(folder: str, prompt_file: str, image: str, gen_len: int, threads: int) -> None:
    """Main venv, genai from the snapshot on PYTHONPATH: what `genai run --image` does, timed."""
    import torch
    from executorch.extension.pybindings import portable_lib

    from genai_pipeline.runtime.multimodal import MultimodalSession
    from genai_pipeline.tokenizer import Tokenizer

    portable_lib._unsafe_reset_threadpool(threads)
    t = time.perf_counter()
    session = MultimodalSession(Path(folder))
    load_s = time.perf_counter() - t
    tokenizer = Tokenizer.from_folder(Path(folder), bos_id=session.manifest.get("bos_id"))
    reference = torch.load(prompt_file)
    text = reference["text"].replace("<image>", session.processing.placeholder)
    ids = session.encode_prompt(tokenizer, text, [Path(image)])
    if ids != reference["ids"]:  # the program must see what transformers' processor makes of the prompt
        raise SystemExit(f"genai's prompt ids differ from the processor's ({len(ids)} vs {len(reference['ids'])})")
    frames = session.frames

    def reset():
        session.reset()
        session.frames = list(frames)

    def prefill():
        logits = session.prefill(ids)
        return int(logits.argmax()), session.vision_seconds

    got = timed_pass(prefill, lambda token: int(session.step(token).argmax()), reset, gen_len)
    print(json.dumps({"load_s": round(load_s, 3), "prompt_tokens": len(ids), **got}))


def worker_run_et_multimodal(pte: str, prompt_file: str, gen_len: int, threads: int) -> None:
    """Main venv (ExecuTorch 1.5.1, as in the optimum venv): a program's `token_embedding`, `vision_encoder` and
    `text_decoder` methods called as ExecuTorch's MultimodalRunner calls them (decoder positions as a range);
    the image's embeddings put at the `<image>` ids' places."""
    import torch
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  custom SDPA and KV-cache update kernels
    from executorch.extension.pybindings import portable_lib
    from executorch.kernels import quantized  # noqa: F401  the quantized ops' kernels

    portable_lib._unsafe_reset_threadpool(threads)
    reference = torch.load(prompt_file)
    ids, pixels = reference["ids"], reference["pixel_values"]
    image_id = SPECIAL["<image>"]
    t = time.perf_counter()
    module = portable_lib._load_for_executorch(pte)
    for method in ("token_embedding", "vision_encoder", "text_decoder"):
        module.load_method(method)
    load_s = time.perf_counter() - t
    slots = [i for i, t in enumerate(ids) if t == image_id]
    pos = [0]

    def decode(embeddings):
        n = embeddings.shape[1]
        logits = module.run_method("text_decoder", (embeddings, torch.arange(pos[0], pos[0] + n, dtype=torch.long)))[0]
        pos[0] += n
        return int(logits.reshape(-1, logits.shape[-1])[-1].argmax())

    def prefill():
        embeddings = module.run_method("token_embedding", (torch.tensor([ids], dtype=torch.long),))[0].clone()
        t = time.perf_counter()
        features = module.run_method("vision_encoder", (pixels,))[0]
        encode_s = time.perf_counter() - t
        embeddings[0, slots] = features.reshape(-1, embeddings.shape[-1])
        return decode(embeddings), encode_s

    def step(token):
        return decode(module.run_method("token_embedding", (torch.tensor([[token]], dtype=torch.long),))[0].clone())

    def reset():
        pos[0] = 0

    got = timed_pass(prefill, step, reset, gen_len)
    print(json.dumps({"load_s": round(load_s, 3), "prompt_tokens": len(ids), **got}))


def worker_run_et_runner(
    pte: str, prompt_file: str, tokenizer: str, pixels_kind: str, gen_len: int, threads: int
) -> None:
    """Main venv: the program in ExecuTorch's own MultimodalRunner (C++ loop and sampler): the prompt's ids before
    the image run, the image, the ids after it; its Stats give TTFT (image encode + prefill + first token) and
    the decode rate. `pixels_kind`: uint8 (genai's encoder normalises inside) or float (the processor's values)."""
    import torch
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  custom SDPA and KV-cache update kernels
    from executorch.extension.llm.runner import GenerationConfig, MultimodalRunner, make_image_input, make_token_input
    from executorch.extension.pybindings import portable_lib
    from executorch.kernels import quantized  # noqa: F401  the quantized ops' kernels

    portable_lib._unsafe_reset_threadpool(threads)
    reference = torch.load(prompt_file)
    ids, pixels = reference["ids"], reference["pixel_values"][0, 0]
    if pixels_kind == "uint8":  # back from the processor's (x / 255 - 0.5) / 0.5 to the image's bytes
        pixels = ((pixels * 0.5 + 0.5) * 255).round().clamp(0, 255).to(torch.uint8)
    image_id = SPECIAL["<image>"]
    first, last = ids.index(image_id), len(ids) - ids[::-1].index(image_id)
    runner = MultimodalRunner(pte, tokenizer)
    stats = []
    for _ in range(2):  # warm-up, timed
        runner.reset()
        inputs = [make_token_input(ids[:first]), make_image_input(pixels.contiguous()), make_token_input(ids[last:])]
        runner.generate(
            inputs, GenerationConfig(echo=False, max_new_tokens=gen_len, temperature=0.0), stats_callback=stats.append
        )
    s = stats[-1]
    decode_ms = s.inference_end_ms - s.first_token_ms
    print(
        json.dumps(
            {
                "ttft_ms": s.first_token_ms - s.inference_start_ms,
                "prompt_tokens": s.num_prompt_tokens,
                "generated_tokens": s.num_generated_tokens,
                "decode_tokens_per_s": round((s.num_generated_tokens - 1) / decode_ms * 1e3, 1)
                if decode_ms > 0
                else None,
            }
        )
    )


MTMD_ENCODE = re.compile(r"mtmd batch encoding done in (\d+) ms")
MTMD_ENCODE_START = "encoding mtmd batch"


def run_mtmd(variant: dict, model: dict, mtmd: dict, args, log: Path, threads: int) -> dict:
    """One llama-mtmd-cli run (the CLI answers one prompt per process, so no warm-up pass). It prints how long
    each image frame took to encode (image tower + projector) but no prompt or decode timings, so those are
    taken from when its output arrives: TTFT = from the first frame's encode start (its log line; the 5-token
    text chunk before it is not counted) to the first generated token on stdout (flushed per token); decode
    rate = tokens after the second over the time they took to arrive. Each token's piece is printed before
    the token is fed back, so the pieces' spacing is the decode steps'."""
    import selectors

    argv = [
        mtmd["binary"],
        "-m",
        variant["file"],
        "--mmproj",
        variant["mmproj"],
        "--image",
        model["image"],
        "-p",
        QUESTION,
        "-n",
        args.gen_len,
        "--ignore-eos",
        "--temp",
        "0",
        "-t",
        threads,
        "-tb",
        threads,
        "-c",
        args.max_seq_len,
        "--no-warmup",
    ]
    child = subprocess.Popen(
        [str(a) for a in argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "LD_LIBRARY_PATH": str(Path(mtmd["binary"]).parent)},
    )
    sel = selectors.DefaultSelector()
    sel.register(child.stdout, selectors.EVENT_READ, "out")
    sel.register(child.stderr, selectors.EVENT_READ, "err")
    err, out_chunks, encode_start, pending = [], [], None, b""
    open_streams = 2
    while open_streams:
        for key, _ in sel.select():
            data = os.read(key.fileobj.fileno(), 65536)
            now = time.perf_counter()
            if not data:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            if key.data == "err":
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace")
                    err.append(text)
                    if encode_start is None and MTMD_ENCODE_START in text:
                        encode_start = now
            elif encode_start is not None:
                out_chunks.append((now, data))
    rc = child.wait()
    log.write_text(
        "\n".join(err)
        + "\n--- stdout, seconds after the first encode started ---\n"
        + "\n".join(f"{t - encode_start:9.3f} {d!r}" for t, d in out_chunks)
        + "\n"
    )
    if rc != 0:
        raise ChildFailed(f"exit {rc}: llama-mtmd-cli\n" + "\n".join(err[-15:]))
    encode = [int(m) for m in MTMD_ENCODE.findall("\n".join(err))]
    generated = [(t, d) for t, d in out_chunks if d.strip()]
    if not encode or encode_start is None or len(generated) < 2:
        raise ChildFailed("llama-mtmd-cli printed no encode timings or tokens:\n" + "\n".join(err[-15:]))
    # The first decode step after the prompt took seconds in trial runs (the CLI's first one-token graph); it is
    # reported apart, and the rate is that of the steps after it.
    first, second, last = generated[0][0], generated[1][0], generated[-1][0]
    steps = len(generated) - 2
    return {
        "encode_ms": float(sum(encode)),
        "image_frames": len(encode),
        "encode_ms_per_frame": round(sum(encode) / len(encode), 1),
        "ttft_ms": round((first - encode_start) * 1e3, 1),
        "first_decode_step_ms": round((second - first) * 1e3, 1),
        "decode_tokens_per_s": round(steps / (last - second), 1) if steps > 0 and last > second else None,
    }


def measure(variant: dict, model: dict, mtmd: dict | None, args, work: Path) -> dict:
    log = work / "logs" / f"run-{variant['id']}.log"
    load = round(os.getloadavg()[0], 2)  # the machine is shared: how busy it was
    prompt_file = work / "smolvlm-256m" / "prompt.pt"
    if not prompt_file.exists():
        run_child(
            [MAIN_PY, "-m", "bench.compare_vlm", "_prompt", model["folder"], prompt_file],
            log=work / "logs" / "prompt.log",
        )
    if variant["system"] == "llamacpp":
        got = run_mtmd(variant, model, mtmd, args, log, args.llamacpp_threads or args.threads)
        rss = None
    else:
        if variant["system"] == "genai":  # genai_pipeline from the snapshot
            src = variant["genai_src"]
            argv = ["_run-genai", Path(variant["file"]).parent, prompt_file, model["image"]]
            cwd, env = src["cwd"], {**src["env"], **ONE_OMP_THREAD}
        else:
            argv = ["_run-et-multimodal", variant["file"], prompt_file]
            cwd, env = ROOT, ONE_OMP_THREAD
        _, rss, out = run_child(
            [MAIN_PY, "-m", "bench.compare_vlm", *argv, args.gen_len, args.threads], log=log, env=env, cwd=cwd
        )
        got = json.loads(out.strip().splitlines()[-1])
    return {**got, **({"run_peak_rss_mb": round(rss)} if rss else {}), "loadavg_1m_before": load}


def summarize(variants: list[dict], samples: dict) -> list[dict]:
    rows = []
    for v in variants:
        got = samples.get(v["id"], [])
        ok = [s for s in got if "error" not in s]
        row = {k: v.get(k) for k in ("system", "recipe_class", "variant", "file_mb", "export_s", "export_peak_rss_mb")}
        for key in (
            "encode_ms",
            "image_frames",
            "ttft_ms",
            "decode_tokens_per_s",
            "load_s",
            "run_peak_rss_mb",
            "prompt_tokens",
        ):
            vals = [s[key] for s in ok if s.get(key) is not None]
            if vals:
                row[key] = round(statistics.median(vals), 1 if key != "load_s" else 3)
                row[f"{key}_samples"] = vals
        row["loadavg_1m_samples"] = [s["loadavg_1m_before"] for s in ok]
        errors = [s["error"] for s in got if "error" in s]
        if errors:
            row["run_error"] = errors[0]
        rows.append(row)
    for row in rows:  # genai / each peer, same recipe class
        if row["system"] != "genai":
            continue
        row["vs_peers"] = {}
        for peer in (r for r in rows if r["system"] != "genai" and r["recipe_class"] == row["recipe_class"]):
            row["vs_peers"][f"{peer['system']} {peer['variant']}"] = {
                k: round(row[k] / peer[k], 2)
                for k in ("file_mb", "export_s", "encode_ms", "ttft_ms", "decode_tokens_per_s")
                if row.get(k) and peer.get(k)
            }
    return rows


def print_table(rows: list[dict], problems: list[dict]) -> None:
    head = (
        f"{'system':<9} {'variant':<19} {'file MB':>8} {'export s':>8} {'encode ms':>9} {'TTFT ms':>8} "
        f"{'decode t/s':>10} {'prompt':>6} {'load avg':>14}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        num = lambda k, w, p=1: f"{r[k]:>{w}.{p}f}" if r.get(k) is not None else f"{'-':>{w}}"
        loads = r.get("loadavg_1m_samples") or []
        load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"
        print(
            f"{r['system']:<9} {r['variant']:<19} {num('file_mb', 8)} {num('export_s', 8)} {num('encode_ms', 9)} "
            f"{num('ttft_ms', 8)} {num('decode_tokens_per_s', 10)} {num('prompt_tokens', 6, 0)} {load:>14}"
            + (f"  run failed: {r['run_error'][:80]}" if r.get("run_error") else "")
        )
    for r in rows:
        for peer, ratios in (r.get("vs_peers") or {}).items():
            print(f"genai {r['variant']} / {peer}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    for p in problems:
        print(f"NOT RUN  {p['system']} {p.get('variant', '')} [{p['stage']}]: {p['reason']}")


# ----------------------------------------------------------------------------- driver


def prepare_variants(args, work: Path, problems: list) -> tuple[dict, list[dict]]:
    say("model")
    model = build_model(work, args.seed)
    variants = []

    def add(system, recipe, name, make, extra=None):
        try:
            say(f"export {system} {name}")
            rec = make()
            if rec.get("failed"):
                problems.append(
                    {
                        "system": system,
                        "variant": name,
                        "stage": "export",
                        "reason": rec["failed"],
                        "command": rec.get("command"),
                        "detail": rec.get("detail"),
                    }
                )
                say(f"  failed: {rec['failed'][:300]}")
                return
            size = rec.get("bytes") or Path(rec["file"]).stat().st_size
            variants.append(
                {
                    "id": f"{system}-{name}",
                    "system": system,
                    "recipe_class": recipe,
                    "variant": name,
                    "file_mb": round(size / 2**20, 1),
                    **rec,
                    **(extra or {}),
                }
            )
            say(f"  {variants[-1]['file_mb']} MB, {rec['export_s']} s")
        except ChildFailed as e:
            problems.append(
                {
                    "system": system,
                    "variant": name,
                    "stage": "export",
                    "reason": last_error_line(e),
                    "detail": str(e)[-3000:],
                }
            )
            say(f"  failed: {last_error_line(e)}")

    base = work / "smolvlm-256m" / "exports"
    if "genai" in args.systems:
        src = genai_source(args.genai_ref, work)
        # exports are keyed by genai_pipeline/'s tree, not the commit: a commit elsewhere does not redo them
        ref = "HEAD" if args.genai_ref == "worktree" else args.genai_ref
        tree = subprocess.run(
            ["git", "rev-parse", f"{ref}:genai_pipeline"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()[:8] + ("-dirty" if src["sha"].endswith("-dirty") else "")
    for recipe in args.recipes:
        if "genai" in args.systems:
            for name, rargs in GENAI_RECIPES[recipe]:
                out = base / f"genai-{tree}-{name}"
                add(
                    "genai",
                    recipe,
                    name,
                    lambda: export_genai(model, name, rargs, out, work, args.max_seq_len, src),
                    {"genai_src": src},
                )
        if "optimum" in args.systems:
            inst = read_install("optimum", problems)
            if inst and recipe == args.recipes[0]:
                probe_optimum_smolvlm(model, work, inst, problems)
            for name, oargs in OPTIMUM_RECIPES[recipe] if inst else []:
                add(
                    "optimum",
                    recipe,
                    name,
                    lambda: export_optimum(model, name, oargs, base / f"optimum-{name}", work, inst, args.max_seq_len),
                )
        if "llamacpp" in args.systems:
            inst = read_install("llamacpp", problems)
            for name, lrec in LLAMACPP_RECIPES[recipe] if inst else []:
                add(
                    "llamacpp",
                    recipe,
                    name,
                    lambda: export_llamacpp(model, name, lrec, base / "llamacpp", work, inst, args.threads),
                )
    return model, variants


def read_install(system: str, problems: list) -> dict | None:
    """The peers' venvs are compare.py's (bench/.envs, maybe a link to venvs shared between work trees)."""
    done = ENVS / system / "done.json"
    if done.exists():
        return json.loads(done.read_text())
    if not any(p["system"] == system and p["stage"] == "install" for p in problems):
        problems.append(
            {
                "system": system,
                "stage": "install",
                "reason": f"{done} is missing: install it with `python -m bench.compare --systems {system}` first",
            }
        )
    return None


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.compare_vlm", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--systems", nargs="+", default=["genai", "optimum", "llamacpp"], choices=["genai", "optimum", "llamacpp"]
    )
    parser.add_argument("--recipes", nargs="+", default=["fp32", "8da4w"], choices=list(GENAI_RECIPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--llamacpp-threads",
        type=int,
        default=0,
        help="llama-mtmd-cli's -t/-tb (default: --threads); on a crowded host ggml's threads, which "
        "wait for each other at every op, may do better with 1",
    )
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--genai-ref", default="HEAD", help="git ref whose genai_pipeline/ is exported and measured, or 'worktree'"
    )
    parser.add_argument(
        "--no-runner-check",
        action="store_true",
        help="skip the one run of each ExecuTorch program in ExecuTorch's MultimodalRunner",
    )
    parser.add_argument("--exports-only", action="store_true", help="stop after the exports (e.g. to run them apart)")
    parser.add_argument("--work", default=str(HERE / ".work"))
    parser.add_argument("--json", default=str(HERE / "results" / "compare_vlm.json"))
    args = parser.parse_args()
    work = Path(args.work).resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    started = time.time()
    problems: list[dict] = []

    model, variants = prepare_variants(args, work, problems)
    if args.exports_only:
        return
    mtmd = None
    if any(v["system"] == "llamacpp" for v in variants):
        say("build llama-mtmd-cli")
        try:
            mtmd = build_mtmd(work)
        except ChildFailed as e:
            problems.append(
                {"system": "llamacpp", "stage": "install", "reason": last_error_line(e), "detail": str(e)[-3000:]}
            )
            variants = [v for v in variants if v["system"] != "llamacpp"]

    samples: dict[str, list] = {}
    for r in range(args.repeats):  # round-robin: every variant once per round
        for v in variants:
            try:
                s = measure(v, model, mtmd, args, work)
            except (ChildFailed, ValueError, KeyError) as e:
                s = {"error": last_error_line(e)}
            samples.setdefault(v["id"], []).append(s)
            say(f"round {r + 1}/{args.repeats} {v['id']}: {s}")

    runner_check = {}
    if not args.no_runner_check:  # ExecuTorch's own MultimodalRunner, once per ExecuTorch program
        for v in variants:
            if v["system"] == "llamacpp":
                continue
            argv = [
                MAIN_PY,
                "-m",
                "bench.compare_vlm",
                "_run-et-runner",
                v["file"],
                work / "smolvlm-256m" / "prompt.pt",
                Path(model["folder"]) / "tokenizer.json",
                "uint8" if v["system"] == "genai" else "float",
                args.gen_len,
                args.threads,
            ]
            load = round(os.getloadavg()[0], 2)
            try:
                _, _, out = run_child(argv, log=work / "logs" / f"runner-{v['id']}.log", env=ONE_OMP_THREAD)
                runner_check[v["id"]] = {**json.loads(out.strip().splitlines()[-1]), "loadavg_1m_before": load}
            except (ChildFailed, ValueError) as e:
                runner_check[v["id"]] = {"error": last_error_line(e)}
            say(f"MultimodalRunner {v['id']}: {runner_check[v['id']]}")

    rows = summarize(variants, samples)
    for row in rows:
        if f"{row['system']}-{row['variant']}" in runner_check:
            row["multimodal_runner"] = runner_check[f"{row['system']}-{row['variant']}"]
    print_table(rows, problems)
    result = {
        "machine": machine(),
        "settings": {
            k: getattr(args, k)
            for k in (
                "systems",
                "recipes",
                "repeats",
                "threads",
                "llamacpp_threads",
                "gen_len",
                "max_seq_len",
                "seed",
                "genai_ref",
            )
        },
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": model,
        "mtmd": mtmd,
        "rows": rows,
        "samples": samples,
        "not_run": problems,
        "loadavg_at_end": os.getloadavg(),
        "wall_s": round(time.time() - started),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


WORKERS = {
    "_build-model": lambda a: worker_build_model(a[0], int(a[1])),
    "_export-optimum": worker_export_optimum,
    "_convert-gguf": lambda a: worker_convert_gguf(*a),
    "_prompt": lambda a: worker_prompt(a[0], a[1]),
    "_run-genai": lambda a: worker_run_genai(a[0], a[1], a[2], int(a[3]), int(a[4])),
    "_run-et-multimodal": lambda a: worker_run_et_multimodal(a[0], a[1], int(a[2]), int(a[3])),
    "_run-et-runner": lambda a: worker_run_et_runner(a[0], a[1], a[2], a[3], int(a[4]), int(a[5])),
}

if __name__ == "__main__":
    main_or_worker(main, WORKERS)
