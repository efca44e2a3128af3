"""llama2.c checkpoints (karpathy/tinyllamas: stories15M.pt, stories110M.pt).

Llama 2's architecture trained on TinyStories by llama2.c's train.py, which saves
`{"model": state dict, "model_args": {...}}` with Meta's tensor names, tied embeddings and Llama
2's SentencePiece tokenizer (32000 pieces, BOS 1, EOS 2). The loader is
`genai_pipeline.checkpoints.llama2c`; sizes are those of the published model_args.
"""

from __future__ import annotations

from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.registry.spec import ModelSpec
from genai_pipeline.tokenizer import TokenizerKind

# llama2.c's model.py keeps Meta's tensor names, which are ours; listed so that the loader refuses
# any other tensor by name.
LLAMA2C_KEY_MAP: tuple[tuple[str, str], ...] = (
    (r"tok_embeddings\.weight", "tok_embeddings.weight"),
    (r"norm\.weight", "norm.weight"),
    (r"output\.weight", "output.weight"),
    (r"layers\.(\d+)\.attention\.(wq|wk|wv|wo)\.weight", r"layers.\1.attention.\2.weight"),
    (r"layers\.(\d+)\.feed_forward\.(w1|w2|w3)\.weight", r"layers.\1.feed_forward.\2.weight"),
    (r"layers\.(\d+)\.(attention_norm|ffn_norm)\.weight", r"layers.\1.\2.weight"),
)


def default_hidden_dim(dim: int, multiple_of: int) -> int:
    """llama2.c's FeedForward width when model_args has no hidden_dim: 2/3 of 4 * dim, rounded up
    to a multiple of `multiple_of`."""
    hidden = int(2 * (4 * dim) / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def config_from_model_args(args: dict) -> DecoderConfig:
    """A llama2.c checkpoint's `model_args` as our DecoderConfig. train.py saves dim, n_layers,
    n_heads, n_kv_heads, vocab_size, multiple_of, max_seq_len and dropout; hidden_dim and norm_eps
    take model.py's defaults when absent. RoPE base 10000 is fixed in model.py; the output layer is
    tied to the embedding there (the loader unties it for a checkpoint whose two tensors differ)."""
    dim, n_heads = int(args["dim"]), int(args["n_heads"])
    hidden_dim = args.get("hidden_dim") or default_hidden_dim(dim, int(args.get("multiple_of", 256)))
    return DecoderConfig(
        vocab_size=int(args["vocab_size"]),
        dim=dim,
        n_layers=int(args["n_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(args.get("n_kv_heads") or n_heads),
        hidden_dim=int(hidden_dim),
        norm_eps=float(args.get("norm_eps", 1e-5)),
        rope_theta=10000.0,
        tie_embeddings=True,
        max_position_embeddings=int(args["max_seq_len"]),
    )


def _spec(name: str, description: str, model_args: dict) -> ModelSpec:
    return ModelSpec(
        name=name,
        family="llama2c",
        description=description,
        config=config_from_model_args(model_args),
        key_map=LLAMA2C_KEY_MAP,
        config_from_checkpoint=config_from_model_args,  # llama2.c folders have no config.json: model_args
        hf_model_types=(),
        bos_id=1,
        eos_ids=(2,),
        checkpoint_format="llama2c",
        tokenizer_kind=TokenizerKind.SENTENCEPIECE,
    )


SPECS = (
    _spec(
        "stories15m",
        "karpathy/tinyllamas stories15M.pt (llama2.c, TinyStories)",
        dict(dim=288, n_layers=6, n_heads=6, n_kv_heads=6, vocab_size=32000, multiple_of=32, max_seq_len=256),
    ),
    _spec(
        "stories110m",
        "karpathy/tinyllamas stories110M.pt (llama2.c, TinyStories)",
        dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000, multiple_of=32, max_seq_len=1024),
    ),
)
