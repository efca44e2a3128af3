"""Hugging Face config.json (transformers 4.x or 5.x layout) -> DecoderConfig fields.

The family modules build their `config_from_hf` from these helpers. A feature we do not
implement is refused with a CheckpointError that names it, never silently ignored.
"""

from __future__ import annotations

import math

from genai_pipeline.errors import CheckpointError
from genai_pipeline.models.decoder import LinearRopeScaling, LongRopeScaling, RopeScaling

# config.json activation names -> DecoderConfig.activation
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def unsupported(what: str) -> CheckpointError:
    return CheckpointError(f"config.json asks for {what}, which this pipeline does not support")


def decoder_fields(hf: dict, tie_default: bool = False) -> dict:
    """Sizes, norm epsilon, activation, head tying and context: what every family has.
    `tie_default`: the family's `tie_word_embeddings` when config.json leaves it out."""
    n_heads = int(hf["num_attention_heads"])
    return dict(
        vocab_size=int(hf["vocab_size"]),
        dim=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        hidden_dim=int(hf["intermediate_size"]),
        head_dim=int(hf.get("head_dim") or 0),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        activation=activation(hf),
        tie_embeddings=bool(hf.get("tie_word_embeddings", tie_default)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
    )


def activation(hf: dict) -> str:
    name = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if name not in ACTIVATIONS:
        raise unsupported(f"activation '{name}' (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def flat_rope_parameters(hf: dict) -> dict:
    """5.x `rope_parameters`, or 4.x `rope_scaling` plus `rope_theta`, as one dict."""
    return hf.get("rope_parameters") or {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 10000.0)}


def rope_fields(hf: dict, params: dict | None = None) -> dict:
    """rope_theta, rope_scaling and rope_dim from `params` (default: the config's only RoPE)."""
    params = flat_rope_parameters(hf) if params is None else params
    head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"]))
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    return dict(
        rope_theta=float(params.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling(hf, params),
        rope_dim=int(head_dim * partial),
    )


def rope_scaling(hf: dict, params: dict) -> RopeScaling | LongRopeScaling | LinearRopeScaling | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return LinearRopeScaling(factor=float(params["factor"]))
    if kind == "llama3":
        return RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    if kind in ("longrope", "su"):  # "su": the name Phi-3's first configs used
        return _longrope(hf, params)
    raise unsupported(f"RoPE scaling '{kind}' (supported: {', '.join(ROPE_TYPES)})")


def _longrope(hf: dict, params: dict) -> LongRopeScaling:
    """As transformers reads it: a top-level `original_max_position_embeddings` wins (Phi-3), the
    attention factor defaults to sqrt(1 + ln(factor) / ln(original)), factor = max / original."""
    original = int(
        hf.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or hf["max_position_embeddings"]
    )
    factor = float(params.get("factor") or int(hf["max_position_embeddings"]) / original)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRopeScaling(
        short_factor=tuple(params["short_factor"]),
        long_factor=tuple(params["long_factor"]),
        original_max_position_embeddings=original,
        attention_factor=float(attention),
    )


def sliding_window_fields(hf: dict) -> dict:
    """sliding_window and sliding_window_layers, from `layer_types` (5.x), Gemma 3's
    `sliding_window_pattern` (every n-th layer global), or every layer (Phi-3)."""
    window = hf.get("sliding_window")
    if not window or not hf.get("use_sliding_window", True):
        return {}
    n_layers = int(hf["num_hidden_layers"])
    if hf.get("layer_types"):
        layers = tuple(i for i, kind in enumerate(hf["layer_types"]) if kind == "sliding_attention")
    elif hf.get("sliding_window_pattern"):
        pattern = int(hf["sliding_window_pattern"])
        layers = tuple(i for i in range(n_layers) if (i + 1) % pattern)
    elif "use_sliding_window" in hf:  # Qwen-style: which layers slide is in layer_types only
        raise unsupported("a sliding window without `layer_types` (re-save the checkpoint with transformers 5)")
    else:
        layers = tuple(range(n_layers))
    return dict(sliding_window=int(window), sliding_window_layers=layers) if layers else {}


def text_config(hf: dict) -> dict:
    """A vision-language config.json's `text_config`, with the composite config's tie flag: the one
    transformers applies to the head."""
    return {
        **hf["text_config"],
        "tie_word_embeddings": hf.get("tie_word_embeddings", hf["text_config"].get("tie_word_embeddings", False)),
    }
