#!/usr/bin/env python3
"""Train the small Llama "reference" model shipped in ``assets/reference/``.

This script is the data source of the project's ``reference`` model: a tiny
(~4.3 M parameter) ``LlamaForCausalLM`` trained from scratch, on CPU, in about
12 minutes, so the export pipeline can be tested end to end on a real (if
small) language model without downloading anything.

How it was trained
------------------
* Corpus: English prose that ships with CPython itself (PSF licence):
  ``pydoc_data.topics.topics`` (the language-reference help topics, split into
  paragraph-aligned chunks of at most ~4 KB) plus module/class/function
  docstrings collected with ``ast`` from the standard library's ``.py`` files
  (tests, idlelib, lib2to3 and site-packages skipped; dedented; only
  docstrings of >= 200 characters of mostly-ASCII prose; exact duplicates
  removed).  Files are read in sorted order, so the corpus is deterministic
  for a given Python version.
* Split: every 20th document is held out (~5 %).  The held-out documents are
  written to ``heldout.txt`` (joined by blank lines, capped at 200 KB); a short
  calibration text from the *training* split is written to ``sample.txt``.
* Tokenizer: byte-level BPE trained with ``tokenizers`` (vocab 4096, no
  normalizer, ``ByteLevel(add_prefix_space=False)`` pre-tokenizer and
  decoder, no post-processor).  The single special token ``<|endoftext|>``
  has id 0 and serves as BOS and EOS; documents are joined as
  ``<|endoftext|>doc<|endoftext|>doc...``.
* Model: Llama, 4 layers, hidden 256, 8 heads / 4 KV heads, MLP 768,
  tied embeddings, context 512.
* Training: AdamW, linear warmup then cosine decay, grad clipping 1.0, random
  256-token windows of the training stream, fixed seeds, 2 CPU threads.  The
  run is bounded by a wall-clock budget (``--minutes``) and a step cap
  (``--steps``); the cosine schedule follows whichever of the two is closer
  to completion, so the LR reaches its floor when the run stops.  Because of
  the wall-clock budget the number of steps (and hence the exact weights)
  depends on machine speed.
* Evaluation: perplexity = exp(mean next-token NLL) over non-overlapping
  256-token windows (the first token of each window is only context).  The
  held-out figure is computed on ``<|endoftext|>`` + the tokens of
  ``heldout.txt`` exactly as shipped, so other tools can reproduce it.

Usage::

    .venv/bin/python tools/train_reference.py --minutes 12
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import shlex
import shutil
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM

EOT = "<|endoftext|>"
SEQ_LEN = 256
HELDOUT_EVERY = 20
HELDOUT_MAX_BYTES = 200_000
SAMPLE_MAX_BYTES = 48_000
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}
PROMPTS = ["The list object", "A function definition"]


# --------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------
def is_prose(text: str, min_chars: int = 200) -> bool:
    """True for long, mostly-ASCII, mostly-letters text."""
    if len(text) < min_chars:
        return False
    ascii_frac = sum(c.isascii() for c in text) / len(text)
    wordy_frac = sum(c.isalpha() or c.isspace() for c in text) / len(text)
    return ascii_frac >= 0.98 and wordy_frac >= 0.75


def chunk_paragraphs(text: str, max_chars: int = 4000) -> list[str]:
    """Split text on blank lines into chunks of at most ~max_chars."""
    chunks, cur = [], ""
    for para in text.split("\n\n"):
        if cur and len(cur) + len(para) + 2 > max_chars:
            chunks.append(cur)
            cur = para
        else:
            cur = f"{cur}\n\n{para}" if cur else para
    if cur:
        chunks.append(cur)
    return [c.strip() for c in chunks if c.strip()]


def pydoc_topic_documents() -> list[str]:
    """The Python reference help topics, chunked into paragraph groups."""
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        docs.extend(chunk_paragraphs(topics[key].strip()))
    return docs


def stdlib_docstring_documents() -> list[str]:
    """Module/class/function docstrings of the stdlib, in sorted file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    files.sort(key=lambda p: p.relative_to(root).as_posix())

    docs = []
    node_types = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, node_types):
                doc = ast.get_docstring(node, clean=True)  # cleandoc == dedent
                if doc:
                    doc = textwrap.dedent(doc).strip()
                    if is_prose(doc):
                        docs.append(doc)
    return docs


def build_corpus() -> tuple[list[str], list[str], str]:
    """Return (train_docs, heldout_docs, description); deterministic."""
    topic_docs = pydoc_topic_documents()
    doc_docs = stdlib_docstring_documents()
    seen, docs = set(), []
    for d in topic_docs + doc_docs:
        if d not in seen:
            seen.add(d)
            docs.append(d)
    train = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    heldout_all = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    # Cap the held-out text; documents beyond the cap are simply unused.
    heldout, size = [], 0
    for d in heldout_all:
        n = len(d.encode("utf-8")) + 2
        if size + n > HELDOUT_MAX_BYTES:
            break
        heldout.append(d)
        size += n
    desc = (
        f"CPython {sys.version.split()[0]} bundled English prose (PSF licence): "
        f"pydoc_data.topics.topics ({len(topic_docs)} paragraph chunks of <=4 KB) + "
        f"{len(doc_docs)} stdlib module/class/function docstrings (ast, >=200 chars "
        f"mostly-ASCII prose; tests/idlelib/lib2to3/site-packages skipped); "
        f"{len(docs)} unique docs, every {HELDOUT_EVERY}th held out "
        f"({len(heldout)} of {len(heldout_all)} held-out docs kept under the "
        f"{HELDOUT_MAX_BYTES // 1000} KB cap, {len(train)} train docs)"
    )
    return train, heldout, desc


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------
def train_tokenizer(train_docs: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with <|endoftext|> as id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_docs, trainer=trainer)
    assert tok.token_to_id(EOT) == 0, "special token must have id 0"
    return tok


def encode_stream(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """<|endoftext|>doc<|endoftext|>doc... as one int32 token stream."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.append(0)
        ids.extend(enc.ids)
    ids.append(0)
    return np.asarray(ids, dtype=np.int32)


# --------------------------------------------------------------------------
# Model / training / evaluation
# --------------------------------------------------------------------------
def make_model(vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=768,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, progress: float, args) -> float:
    """Linear warmup over args.warmup steps, then cosine decay to lr*min_ratio."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = min(max(progress, 0.0), 1.0)
    floor = args.lr * args.min_lr_ratio
    return floor + 0.5 * (args.lr - floor) * (1.0 + math.cos(math.pi * p))


def train(model, train_ids: np.ndarray, args) -> tuple[int, float]:
    """Train until --minutes or --steps runs out; return (steps, seconds)."""
    data = torch.from_numpy(train_ids.astype(np.int64))
    gen = torch.Generator().manual_seed(0)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    budget = args.minutes * 60.0
    model.train()
    t0 = time.time()
    t_log, tok_log, step = t0, 0, 0
    n_windows = len(data) - SEQ_LEN - 1
    while step < args.steps:
        elapsed = time.time() - t0
        if elapsed >= budget:
            break
        progress = max(step / args.steps, elapsed / budget)
        lr = lr_at(step, progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n_windows, (args.batch_size,), generator=gen)
        batch = torch.stack([data[s : s + SEQ_LEN + 1] for s in starts.tolist()])
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tok_log += batch[:, :-1].numel()
        if step % args.log_every == 0 or step == 1:
            now = time.time()
            print(
                f"step {step:5d}  loss {loss.item():.4f}  lr {lr:.2e}  "
                f"{tok_log / (now - t_log):7.0f} tok/s  elapsed {now - t0:6.1f}s",
                flush=True,
            )
            t_log, tok_log = now, 0
    return step, time.time() - t0


@torch.no_grad()
def perplexity(model, ids: np.ndarray, batch_size: int = 16) -> tuple[float, int]:
    """exp(mean NLL) over non-overlapping SEQ_LEN windows; returns (ppl, n_predicted)."""
    model.eval()
    t = torch.from_numpy(ids.astype(np.int64))
    windows = [t[i : i + SEQ_LEN] for i in range(0, len(t) - 1, SEQ_LEN)]
    windows = [w for w in windows if len(w) >= 2]
    total_nll, total_n = 0.0, 0
    for i in range(0, len(windows), batch_size):
        group = windows[i : i + batch_size]
        # Ragged last window: evaluate separately.
        for sub in [group] if len({len(w) for w in group}) == 1 else [[w] for w in group]:
            x = torch.stack(sub)
            logits = model(input_ids=x).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"
            )
            total_nll += nll.item()
            total_n += x[:, 1:].numel()
    return math.exp(total_nll / total_n), total_n


@torch.no_grad()
def continuations(model, tok: Tokenizer, prompts: list[str], n_new: int = 60) -> dict[str, str]:
    """Greedy continuations (repetition allowed) with model.generate."""
    model.eval()
    out = {}
    for prompt in prompts:
        ids = torch.tensor([[0] + tok.encode(prompt, add_special_tokens=False).ids])
        gen = model.generate(
            ids,
            max_new_tokens=n_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )
        out[prompt] = tok.decode(gen[0, 1:].tolist(), skip_special_tokens=False)
    return out


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------
def write_tokenizer_config(out: Path) -> None:
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": None,
        "pad_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def parse_args() -> argparse.Namespace:
    here = Path(__file__).resolve().parents[1] / "assets"
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=here / "reference", help="output folder")
    ap.add_argument("--minutes", type=float, default=12.0, help="training wall-clock budget")
    ap.add_argument("--steps", type=int, default=100_000, help="step cap")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences of 256 tokens per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=20)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    command = shlex.join([os.path.relpath(sys.executable)] + sys.argv)
    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)

    train_docs, heldout_docs, corpus_desc = build_corpus()
    print(corpus_desc, flush=True)
    heldout_text = "\n\n".join(heldout_docs) + "\n"

    tok = train_tokenizer(train_docs, args.vocab_size)
    train_ids = encode_stream(tok, train_docs)
    heldout_ids = np.asarray([0] + tok.encode(heldout_text, add_special_tokens=False).ids, dtype=np.int32)
    print(
        f"tokenizer: vocab {tok.get_vocab_size()}  train tokens {len(train_ids):,}  "
        f"held-out tokens {len(heldout_ids):,}  "
        f"({time.time() - t_start:.1f}s)",
        flush=True,
    )

    # Calibration sample from the training split: whole documents, <= ~48 KB.
    sample, size = [], 0
    for d in train_docs[::7]:
        if size + len(d.encode("utf-8")) + 2 > SAMPLE_MAX_BYTES:
            break
        sample.append(d)
        size += len(d.encode("utf-8")) + 2
    sample_text = "\n\n".join(sample) + "\n"

    model = make_model(tok.get_vocab_size())
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)
    assert n_params <= 10_000_000

    steps, train_seconds = train(model, train_ids, args)

    heldout_ppl, heldout_n = perplexity(model, heldout_ids)
    # Train perplexity on an evenly spaced subset of the training stream of
    # about the same size as the held-out set (full pass would be too slow).
    n_win = max(1, len(heldout_ids) // SEQ_LEN)
    stride = max(SEQ_LEN, (len(train_ids) // n_win) // SEQ_LEN * SEQ_LEN)
    train_sub = np.concatenate([train_ids[i : i + SEQ_LEN] for i in range(0, len(train_ids) - SEQ_LEN, stride)][:n_win])
    train_ppl, train_n = perplexity(model, train_sub)
    samples = continuations(model, tok, PROMPTS)

    # Write everything to a temp folder next to the target, then swap it in.
    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    # Prompts start with <|endoftext|>, as every training document did. The post-processor says so
    # in tokenizer.json itself, where Hugging Face and ExecuTorch's C++ tokenizer both read it.
    tok.post_processor = processors.TemplateProcessing(single=f"{EOT} $A", special_tokens=[(EOT, 0)])
    tok.save(str(tmp / "tokenizer.json"))
    write_tokenizer_config(tmp)
    (tmp / "heldout.txt").write_text(heldout_text, encoding="utf-8")
    (tmp / "sample.txt").write_text(sample_text, encoding="utf-8")
    report = {
        "params": n_params,
        "vocab_size": tok.get_vocab_size(),
        "train_tokens": int(len(train_ids)),
        "heldout_tokens": int(len(heldout_ids)),
        "steps": steps,
        "tokens_seen": steps * args.batch_size * SEQ_LEN,
        "epochs": round(steps * args.batch_size * SEQ_LEN / len(train_ids), 2),
        "batch_size": args.batch_size,
        "seq_len": SEQ_LEN,
        "lr": args.lr,
        "warmup_steps": args.warmup,
        "min_lr_ratio": args.min_lr_ratio,
        "weight_decay": args.weight_decay,
        "train_seconds": round(train_seconds, 1),
        "wall_seconds": round(time.time() - t_start, 1),
        "heldout_perplexity": round(heldout_ppl, 3),
        "heldout_predicted_tokens": heldout_n,
        "train_perplexity": round(train_ppl, 3),
        "train_perplexity_predicted_tokens": train_n,
        "eval_protocol": (
            "exp(mean next-token NLL) over non-overlapping 256-token windows; "
            "held-out = [<|endoftext|>] + tokens of heldout.txt; train = evenly "
            "spaced 256-token windows of the training stream"
        ),
        "corpus": corpus_desc,
        "torch_version": torch.__version__,
        "command": command,
        "greedy_samples": samples,
    }
    (tmp / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    os.chmod(tmp, 0o755)  # mkdtemp creates 0700; ship normal permissions
    for f in tmp.iterdir():
        os.chmod(f, 0o644)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)

    print(json.dumps({k: v for k, v in report.items() if k != "greedy_samples"}, indent=2))
    for prompt, text in samples.items():
        print(f"\n--- greedy: {prompt!r}\n{text}")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
