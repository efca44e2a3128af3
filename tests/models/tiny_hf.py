"""Tiny checkpoints of every family, built and saved by `transformers` itself, and the
comparison of our decoder against the transformers model that made them (the oracle)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from conftest import TINY_VOCAB

from genai_pipeline.checkpoints.hf import load_decoder
from genai_pipeline.registry import get_spec

BASE = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
MAX_SEQ = 64  # cache length of the tests: the sliding windows below (8) are much shorter


@dataclass(frozen=True)
class Family:
    """A family's tiny test model: its transformers config class and the registry entry reading it."""

    model_type: str
    config_class: str  # in `transformers`
    spec: str
    config: dict = field(default_factory=dict)


FAMILIES = {
    f.model_type: f
    for f in (
        Family(
            "llama",
            "LlamaConfig",
            "llama3_2-1b",
            dict(
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
                rope_theta=50000.0,
            ),
        ),
        Family("qwen2", "Qwen2Config", "qwen2_5-0_5b"),
        Family("qwen3", "Qwen3Config", "qwen3-0_6b", dict(head_dim=32)),
        Family("smollm3", "SmolLM3Config", "smollm3-3b", dict(no_rope_layers=[1, 0])),  # layer 1 has no RoPE
        Family(
            "granite",
            "GraniteConfig",
            "granite3_3-2b",
            dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.09, logits_scaling=2.5),
        ),
        Family("olmo2", "Olmo2Config", "olmo2-1b"),
        Family("mistral", "MistralConfig", "mistral-7b-v0_3", dict(sliding_window=8)),  # every layer slides
        Family("lfm2", "Lfm2Config", "lfm2-350m", dict(layer_types=["conv", "full_attention"])),
        Family(
            "phi3",
            "Phi3Config",
            "phi_4_mini",
            # short factors: MAX_SEQ fits the original context; every layer slides (as Phi-3 does)
            dict(
                partial_rotary_factor=0.75,
                original_max_position_embeddings=MAX_SEQ,
                sliding_window=8,
                tie_word_embeddings=True,
                rope_scaling={
                    "type": "longrope",
                    "short_factor": [1.0, 1.3, 1.7, 2.2, 3.0, 4.0],
                    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
                },
            ),
        ),
        Family(
            "gemma3_text",
            "Gemma3TextConfig",
            "gemma3-1b",
            dict(
                head_dim=32,
                query_pre_attn_scalar=24,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                },
            ),
        ),
    )
}


# Families of the same decoder path as one above, checked in eager only (no program of their own).
EAGER_ONLY = {
    # Ministral: sliding layers named in layer_types, the others full
    "ministral": Family(
        "ministral",
        "MinistralConfig",
        "ministral-8b",
        dict(
            head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
        ),  # transformers 5.25 fails without head_dim
    ),
}


def train_ascii_tokenizer(path: Path, vocab_size: int = TINY_VOCAB) -> Path:
    """A byte-level BPE (the form ExecuTorch's C++ tokenizer reads) whose every token is ASCII text:
    a random model's tokens then each decode to text alone, which TextLLMRunner's Python callback
    needs (it raises UnicodeDecodeError on a lone byte of a multi-byte character)."""
    import pydoc_data.topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    # GPT-2's byte -> character table (ByteLevel's alphabet): printable bytes stand for themselves,
    # the others for 256 + n in byte order
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    char = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    text = "\n".join(sorted(pydoc_data.topics.topics.values()))[:200_000].encode("ascii", "ignore").decode()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=[char[b] for b in range(128)]
    )
    tok.train_from_iterator([text], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    tok.save(str(path))
    assert tok.get_vocab_size() == vocab_size
    return Path(path)


def save_tiny(folder: Path, model_type: str, std: float = 0.08, seed: int = 0, **config) -> Path:
    """Random weights (std `std`, norms around 1) saved by transformers in Hugging Face format."""
    import transformers

    family = FAMILIES.get(model_type) or EAGER_ONLY[model_type]
    hf_config = getattr(transformers, family.config_class)(**{**BASE, **family.config, **config})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, std) if "norm" not in name else p.normal_(1.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    return Path(folder)


def max_diff_to_transformers(folder: Path, spec_name: str, prefill: int = 16, steps: int = 8) -> float:
    """Our eager decoder (16-token prefill, then 8 one-token steps) against the transformers model
    on all 24 tokens at once: the max abs difference of the logits, fp32."""
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_decoder(get_spec(spec_name), folder, max_seq_len=MAX_SEQ)
    ids = torch.randint(0, TINY_VOCAB, (1, prefill + steps), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits[0]
        got = [ours(ids[:, :prefill], torch.tensor([0]))[0]]
        for i in range(prefill, prefill + steps):
            got.append(ours(ids[:, i : i + 1], torch.tensor([i]))[0])
    assert expected.abs().max() > 0.5, "logits too flat to make the comparison meaningful"
    return (torch.cat(got) - expected).abs().max().item()
