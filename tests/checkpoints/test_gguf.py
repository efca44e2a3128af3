"""GGUF checkpoints: tiny GGUFs written here from tiny transformers models (q/k permuted as
llama.cpp's converter permutes llama's), every quantization type we read, against the transformers
model holding the same dequantized weights; and the real SmolLM2-135M-Instruct Q4_1 GGUF against
transformers' own GGUF loader and tokenizer, and ExecuTorch's C++ tokenizer."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from genai_pipeline.checkpoints import gguf as ours
from genai_pipeline.checkpoints import gguf_q4_0, gguf_vocab, infer_checkpoint_spec, load_decoder, metadata_folder
from genai_pipeline.errors import CheckpointError
from genai_pipeline.registry import infer_spec
from tests.conftest import REPO, TINY_MAX_SEQ, TINY_VOCAB, save_hf_checkpoint, train_sentencepiece, train_tokenizer

Q = gguf.GGMLQuantizationType
SMOLLM2 = REPO / ".cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT_IDS = [1, 5, 77, 200, 3, 42, 311, 9]

# HF name suffix -> GGUF name (layer index substituted); the same table llama.cpp's converter applies.
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


# What differs per architecture in llama.cpp's tensor names.
ARCH_NAMES = {
    "gemma3": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    },
    "phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "olmo2": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    },
    "lfm2": {
        "model.embedding_norm.weight": "token_embd_norm.weight",
        "operator_norm.weight": "attn_norm.weight",
        "ffn_norm.weight": "ffn_norm.weight",
        "self_attn.out_proj.weight": "attn_output.weight",
        "self_attn.q_layernorm.weight": "attn_q_norm.weight",
        "self_attn.k_layernorm.weight": "attn_k_norm.weight",
        "conv.conv.weight": "shortconv.conv.weight",
        "conv.in_proj.weight": "shortconv.in_proj.weight",
        "conv.out_proj.weight": "shortconv.out_proj.weight",
        "feed_forward.w1.weight": "ffn_gate.weight",
        "feed_forward.w3.weight": "ffn_up.weight",
        "feed_forward.w2.weight": "ffn_down.weight",
    },
}
# Architectures whose q/k rows llama.cpp's converter permutes (its LlamaModel and subclasses).
PERMUTED = ("llama", "smollm3", "granite")


def gguf_name(hf_name: str, arch: str) -> str:
    names = {**HF_TO_GGUF, **ARCH_NAMES.get(arch, {})}
    if hf_name in names:
        return names[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{names[rest]}"


def llama3_rope_freqs(c) -> np.ndarray:
    """The frequency divisors llama.cpp's converter writes as rope_freqs for Llama 3 scaling."""
    p = c.rope_parameters
    head_dim = c.hidden_size // c.num_attention_heads
    freqs = 1.0 / p["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"]
            )
            out.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> interleaved pairs per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantized(values: np.ndarray, kind: Q) -> tuple[np.ndarray, np.ndarray]:
    """(what the GGUF stores, the float32 values it stands for)."""
    if kind == Q.F32:
        return values, values
    if kind == Q.F16:
        stored = values.astype(np.float16)
        return stored, stored.astype(np.float32)
    stored = gguf.quants.quantize(values, kind)
    return stored, gguf.quants.dequantize(stored, kind).reshape(values.shape)


def write_tokenizer(writer: gguf.GGUFWriter, tokenizer_json: Path, pre: str = "gpt2") -> None:
    """A trained byte-level BPE tokenizer.json as llama.cpp's converter stores it (gpt2 kind)."""
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in data["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def write_gguf(path: Path, arch: str, model, types: list[Q], tokenizer_json: Path) -> Path:
    """The transformers model as a GGUF of `arch`, 2-D tensors stored in `types` in turn (norms F32);
    the model's own weights are replaced by what the GGUF stores, dequantized, so both hold the same."""
    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    if arch == "lfm2":  # LFM2Model.set_gguf_parameters: the MLP's width as used, KV heads per layer (0: conv)
        writer.add_feed_forward_length(model.model.layers[0].feed_forward.w1.out_features)
        writer.add_head_count_kv([c.num_key_value_heads if k == "full_attention" else 0 for k in c.layer_types])
        writer.add_shortconv_l_cache(c.conv_L_cache)
    else:
        writer.add_feed_forward_length(c.intermediate_size)
        writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_head_count(c.num_attention_heads)
    writer.add_layer_norm_rms_eps(c.norm_eps if arch == "lfm2" else c.rms_norm_eps)
    if arch != "gemma3":
        writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if arch in (*PERMUTED, "phi3"):
        writer.add_rope_dimension_count(int(head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0)))
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(c.sliding_window)
        writer.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        writer.add_sliding_window(c.sliding_window or 0)
        if c.rope_parameters.get("rope_type") == "longrope":
            writer.add_tensor("rope_factors_long.weight", np.array(c.rope_parameters["long_factor"], dtype=np.float32))
            writer.add_tensor(
                "rope_factors_short.weight", np.array(c.rope_parameters["short_factor"], dtype=np.float32)
            )
            scale = c.max_position_embeddings / c.original_max_position_embeddings
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(c.original_max_position_embeddings))
            )
    if arch == "granite":  # GraniteModel.set_gguf_parameters
        writer.add_attention_scale(c.attention_multiplier)
        writer.add_embedding_scale(c.embedding_multiplier)
        writer.add_residual_scale(c.residual_multiplier)
        writer.add_logit_scale(c.logits_scaling)
    if arch == "llama" and c.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(c))
    write_tokenizer(writer, tokenizer_json)
    state = model.state_dict()
    n = 0
    with torch.no_grad():
        for name, tensor in state.items():
            if name == "lm_head.weight" and c.tie_word_embeddings:
                continue  # llama.cpp stores a tied head once, as token_embd
            values = tensor.float().numpy().copy()
            if name.endswith("conv.conv.weight"):
                values = values.squeeze(1)  # LFM2Model.modify_tensors: the conv op takes 2-D
            if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
                values = llama_cpp_permute(values, heads)
            quantizable = values.ndim == 2 and values.shape[1] % 32 == 0  # llama.cpp keeps short rows in F32
            kind = types[n % len(types)] if quantizable else Q.F32
            n += quantizable
            if arch == "gemma3" and name.endswith("norm.weight"):
                values = values + 1  # llama.cpp's converter: its RMSNorm scales by weight, Gemma's by 1 + weight
            stored, dequantized = quantized(values, kind)
            writer.add_tensor(gguf_name(name, arch), stored, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
            if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
                dequantized = ours.interleaved_to_halves(torch.from_numpy(dequantized), heads).numpy()
            if arch == "gemma3" and name.endswith("norm.weight"):
                dequantized = dequantized - 1
            tensor.copy_(torch.from_numpy(dequantized).reshape(tensor.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", TINY_VOCAB)


def tiny(tmp_path: Path, tokenizer_json: Path, model_type: str, arch: str, types: list[Q], **config):
    import transformers

    if model_type in ("llama", "qwen2", "qwen3"):
        save_hf_checkpoint(tmp_path / "hf", model_type=model_type, **config)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    else:
        model = random_model(model_type, **config)
    return write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, model, types, tokenizer_json), model


def random_model(model_type: str, **config):
    """Gemma 3 / Phi-3 / SmolLM3 / Granite / OLMo 2 at the size of conftest's tiny models, random weights (norms around one)."""
    import transformers

    classes = {
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
        "lfm2": (transformers.Lfm2Config, transformers.Lfm2ForCausalLM),
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
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**defaults, **config})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08) if "norm" not in name else p.normal_(0.0 if model_type == "gemma3_text" else 1.0, 0.1)
    return model


def assert_same_logits(file: Path, reference) -> None:
    spec, _ = infer_checkpoint_spec(file)
    decoder = load_decoder(spec, file, TINY_MAX_SEQ)
    tokens = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        expected = reference(tokens).logits[0]
        actual = decoder(tokens, torch.tensor([0]), last_only=False)[0]
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= 1e-4


ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


def test_llama_permuted_qk_every_type(tmp_path, tokenizer_json):
    file, model = tiny(tmp_path, tokenizer_json, "llama", "llama", ALL_TYPES)
    assert ours.read_config(file)["tie_word_embeddings"] is False
    assert_same_logits(file, model)


def test_open_decoder_reads_a_block_when_asked(tmp_path, tokenizer_json):
    """A GGUF opens as the decoder on the meta device and a loader (what the streamed export and
    the offloaded float model read): a block's tensors are dequantized when it is loaded, equal to
    the whole model's, and the other blocks stay unread."""
    from genai_pipeline.checkpoints import open_decoder

    file, _ = tiny(tmp_path, tokenizer_json, "llama", "llama", [Q.Q8_0, Q.Q4_0])
    spec, _ = infer_checkpoint_spec(file)
    whole = load_decoder(spec, file, TINY_MAX_SEQ)
    lazy, loader = open_decoder(spec, file, TINY_MAX_SEQ)
    assert loader is not None and all(p.is_meta for p in lazy.parameters())
    block = loader.load_block(lazy, 1)
    assert all(p.is_meta for p in lazy.layers[0].parameters()) and lazy.tok_embeddings.weight.is_meta
    for name, p in block.named_parameters():
        assert not p.is_meta and torch.equal(p, whole.layers[1].get_parameter(name)), name


def test_llama_tied_head(tmp_path, tokenizer_json):
    file, model = tiny(tmp_path, tokenizer_json, "llama", "llama", [Q.Q8_0, Q.Q4_0], tie_word_embeddings=True)
    assert ours.read_config(file)["tie_word_embeddings"] is True
    assert_same_logits(file, model)


def test_qwen2_biases(tmp_path, tokenizer_json):
    file, model = tiny(tmp_path, tokenizer_json, "qwen2", "qwen2", [Q.Q5_1, Q.Q4_1, Q.F16, Q.BF16])
    assert infer_checkpoint_spec(file)[0].family == "qwen2"
    assert_same_logits(file, model)


def test_qwen3_qk_norms(tmp_path, tokenizer_json):
    file, model = tiny(tmp_path, tokenizer_json, "qwen3", "qwen3", [Q.Q5_0, Q.Q8_0, Q.F32], head_dim=32)
    assert infer_checkpoint_spec(file)[0].family == "qwen3"
    assert_same_logits(file, model)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path, tokenizer_json):
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
    }
    file, model = tiny(
        tmp_path, tokenizer_json, "llama", "llama", [Q.F32], rope_parameters=rope, max_position_embeddings=16384
    )
    assert ours.read_config(file)["rope_scaling"]["factor"] == 8.0
    assert_same_logits(file, model)


def test_gemma3_norm_offset_and_sliding_window(tmp_path, tokenizer_json):
    # both layers slide (5 of every 6 do), over a window shorter than the prompt
    file, model = tiny(
        tmp_path,
        tokenizer_json,
        "gemma3_text",
        "gemma3",
        [Q.Q8_0, Q.F16],
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=16,
        tie_word_embeddings=True,
    )
    config = ours.read_config(file)
    assert (config["model_type"], config["sliding_window"], config["sliding_window_pattern"]) == ("gemma3_text", 4, 6)
    assert_same_logits(file, model)


def test_phi3_fused_qkv_gate_up_and_longrope(tmp_path, tokenizer_json):
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [2.0, 3.0, 5.0, 8.0],
    }
    file, model = tiny(
        tmp_path,
        tokenizer_json,
        "phi3",
        "phi3",
        [Q.Q5_0, Q.Q4_1],
        rope_parameters=rope,
        # short factors: our program picks them when its cache fits the original context, as
        # transformers does while the sequence does
        original_max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    assert ours.read_config(file)["partial_rotary_factor"] == 0.5
    assert_same_logits(file, model)


def test_smollm3_permuted_qk_and_every_fourth_layer_without_rope(tmp_path, tokenizer_json):
    # 4 layers: the 4th has no RoPE, in transformers' default as in llama.cpp
    file, model = tiny(tmp_path, tokenizer_json, "smollm3", "smollm3", [Q.Q8_0, Q.F16], num_hidden_layers=4)
    spec, _ = infer_checkpoint_spec(file)
    assert spec.family == "smollm3" and spec.config.nope_layers == (3,)
    assert_same_logits(file, model)


def test_granite_multipliers_from_scales(tmp_path, tokenizer_json):
    multipliers = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.09, logits_scaling=2.5)
    file, model = tiny(tmp_path, tokenizer_json, "granite", "granite", [Q.Q8_0, Q.F32], **multipliers)
    config = infer_checkpoint_spec(file)[0].config
    assert (config.embedding_multiplier, config.residual_multiplier) == (3.0, 0.5)
    assert (config.attention_scale, config.logit_divisor) == pytest.approx((0.09, 2.5))  # stored as float32
    assert_same_logits(file, model)


def test_olmo2_post_norms_and_whole_projection_qk_norms(tmp_path, tokenizer_json):
    file, model = tiny(tmp_path, tokenizer_json, "olmo2", "olmo2", [Q.Q5_1, Q.F16])
    assert infer_checkpoint_spec(file)[0].family == "olmo2"
    assert_same_logits(file, model)


def test_lfm2_convolution_layers_from_per_layer_kv_heads(tmp_path, tokenizer_json):
    kinds = ["conv", "full_attention", "conv"]
    file, model = tiny(
        tmp_path, tokenizer_json, "lfm2", "lfm2", [Q.Q8_0, Q.F16], num_hidden_layers=3, layer_types=kinds
    )
    spec, _ = infer_checkpoint_spec(file)
    config = load_decoder(spec, file, TINY_MAX_SEQ).config
    assert spec.family == "lfm2" and config.conv_layers == (0, 2) and config.n_kv_heads == 2
    assert_same_logits(file, model)


def test_read_q4_0_is_lossless_and_unpermuted(tmp_path, tokenizer_json):
    file, _ = tiny(tmp_path, tokenizer_json, "llama", "llama", [Q.Q4_0])
    spec, _ = infer_checkpoint_spec(file)
    decoder = load_decoder(spec, file, TINY_MAX_SEQ)
    weights = decoder.state_dict()
    unpacked = gguf_q4_0.read_q4_0(file)
    assert "layers.0.attention.wq.weight" in unpacked and "tok_embeddings.weight" in unpacked
    for name, (q, scales) in unpacked.items():
        assert q.dtype == torch.int8 and scales.dtype == torch.float32
        assert q.min() >= -8 and q.max() <= 7
        assert scales.shape == (q.shape[0], q.shape[1] // 32)
        # our loader's weights went through gguf.quants.dequantize: d * q must equal them exactly
        assert torch.equal(q.float() * scales.repeat_interleave(32, dim=1), weights[name]), name


def test_converted_tokenizer_and_metadata_files(tmp_path, tokenizer_json):
    from tokenizers import Tokenizer

    file, _ = tiny(tmp_path, tokenizer_json, "llama", "llama", [Q.F16])
    folder = metadata_folder(file)
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert infer_spec(json.loads((folder / "config.json").read_text())).family == "llama"
    converted, original = Tokenizer.from_file(str(folder / "tokenizer.json")), Tokenizer.from_file(str(tokenizer_json))
    for text in ["The list object", "  spaces\tand\nnewlines 12345", "<|endoftext|>x", "émigré ünïcode ✓"]:
        assert converted.encode(text).ids == original.encode(text).ids, text
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|endoftext|>" and config["add_bos_token"] is True
    assert config["chat_template"].startswith("{% for m in messages %}")
    assert json.loads((folder / "generation_config.json").read_text()) == {"bos_token_id": 0, "eos_token_id": 0}


def test_sentencepiece_vocabulary(tmp_path):
    """A SentencePiece (llama kind) vocabulary as llama.cpp's converter stores it: pieces, scores and
    types, no merges; encoded as SentencePiece itself does, by our runtime and ExecuTorch's tokenizer."""
    import sentencepiece
    from pytorch_tokenizers import CppHFTokenizer

    from genai_pipeline.tokenizer import Tokenizer

    sp = sentencepiece.SentencePieceProcessor(model_file=str(train_sentencepiece(tmp_path / "tokenizer.model", 512)))
    n = sp.get_piece_size()
    kinds = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    writer = gguf.GGUFWriter(str(tmp_path / "sp.gguf"), "llama")
    for add, value in [("embedding_length", 32), ("block_count", 1), ("feed_forward_length", 64), ("head_count", 2)]:
        getattr(writer, f"add_{add}")(value)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types(kinds)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_space_prefix(True)
    writer.add_tensor("token_embd.weight", np.zeros((n, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = metadata_folder(tmp_path / "sp.gguf")
    runtime = Tokenizer.from_folder(folder)
    cpp = CppHFTokenizer()
    cpp.load(str(folder / "tokenizer.json"))
    for text in ["The list object", "Return the value 12345.", "a  b   c\nnew line", "naïve café ✓"]:
        expected = sp.encode(text)
        assert runtime.encode(text, add_special_tokens=False) == expected, text
        assert runtime.encode(text) == [1, *expected], text  # add_bos_token defaults on for SentencePiece
        assert cpp.encode(text, 0, 0) == expected, text
        assert runtime.decode(expected) == sp.decode(expected), text


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "qwen2", "llama-bpe", "unknown-pre"])
def test_byte_level_pre_tokenizers_read_alike_by_executorch(tmp_path, tokenizer_json, pre):
    """Each split llama.cpp names (tokenizer.ggml.pre) in a form ExecuTorch's C++ tokenizer reads as
    `tokenizers` does."""
    from pytorch_tokenizers import CppHFTokenizer

    from genai_pipeline.tokenizer import Tokenizer

    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    for add, value in [("embedding_length", 32), ("block_count", 1), ("feed_forward_length", 64), ("head_count", 2)]:
        getattr(writer, f"add_{add}")(value)
    write_tokenizer(writer, tokenizer_json, pre)
    writer.add_tensor("token_embd.weight", np.zeros((TINY_VOCAB, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder = metadata_folder(tmp_path / "t.gguf")
    runtime = Tokenizer.from_folder(folder)
    cpp = CppHFTokenizer()
    cpp.load(str(folder / "tokenizer.json"))
    for text in ["The list object's value", "x = 12345 + 6789;\n\n  indented", "<|endoftext|>After", "naïve ✓ 日本"]:
        assert cpp.encode(text, 0, 0) == runtime.encode(text, add_special_tokens=False), text


# -- K-quants: gguf.quants cannot write them, so blocks are built by hand and decoded by ggml's formulas


def _scale_min_k4(j: int, scales: bytes) -> tuple[int, int]:
    if j < 4:
        return scales[j] & 63, scales[j + 4] & 63
    return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)


def _f16(b: bytes) -> float:
    return float(np.frombuffer(b, dtype=np.float16)[0])


def reference_q4_k(block: bytes) -> list[float]:
    d, dmin, scales, qs = _f16(block[0:2]), _f16(block[2:4]), block[4:16], block[16:144]
    out = []
    for chunk in range(4):
        (s1, m1), (s2, m2) = _scale_min_k4(2 * chunk, scales), _scale_min_k4(2 * chunk + 1, scales)
        q = qs[32 * chunk : 32 * chunk + 32]
        out += [d * s1 * (b & 0xF) - dmin * m1 for b in q] + [d * s2 * (b >> 4) - dmin * m2 for b in q]
    return out


def reference_q5_k(block: bytes) -> list[float]:
    d, dmin, scales, qh, qs = _f16(block[0:2]), _f16(block[2:4]), block[4:16], block[16:48], block[48:176]
    out = []
    for chunk in range(4):
        (s1, m1), (s2, m2) = _scale_min_k4(2 * chunk, scales), _scale_min_k4(2 * chunk + 1, scales)
        q = qs[32 * chunk : 32 * chunk + 32]
        low, high = 1 << (2 * chunk), 2 << (2 * chunk)
        out += [d * s1 * ((b & 0xF) + (16 if qh[i] & low else 0)) - dmin * m1 for i, b in enumerate(q)]
        out += [d * s2 * ((b >> 4) + (16 if qh[i] & high else 0)) - dmin * m2 for i, b in enumerate(q)]
    return out


def reference_q6_k(block: bytes) -> list[float]:
    ql, qh, scales, d = block[0:128], block[128:192], np.frombuffer(block[192:208], dtype=np.int8), _f16(block[208:210])
    out = [0.0] * 256
    for half in range(2):
        l_, h_, s_, y = ql[64 * half :], qh[32 * half :], scales[8 * half :], 128 * half
        for i in range(32):
            k = i // 16
            q1 = ((l_[i] & 0xF) | ((h_[i] & 3) << 4)) - 32
            q2 = ((l_[i + 32] & 0xF) | (((h_[i] >> 2) & 3) << 4)) - 32
            q3 = ((l_[i] >> 4) | (((h_[i] >> 4) & 3) << 4)) - 32
            q4 = ((l_[i + 32] >> 4) | (((h_[i] >> 6) & 3) << 4)) - 32
            out[y + i], out[y + i + 32] = d * s_[k] * q1, d * s_[k + 2] * q2
            out[y + i + 64], out[y + i + 96] = d * s_[k + 4] * q3, d * s_[k + 6] * q4
    return out


@pytest.mark.parametrize(
    "kind, reference", [(Q.Q4_K, reference_q4_k), (Q.Q5_K, reference_q5_k), (Q.Q6_K, reference_q6_k)]
)
def test_k_quant_dequantization(tmp_path, kind, reference):
    rng = np.random.default_rng(int(kind))
    rows, cols = 3, 512
    block_bytes = gguf.quants.quant_shape_to_byte_shape((1, 256), kind)[1]
    raw = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    # finite fp16 scales (random bytes could be inf/nan): d at the end for Q6_K, d and dmin first otherwise
    offsets = [block_bytes - 2] if kind == Q.Q6_K else [0, 2]
    for offset in offsets:
        raw[..., offset : offset + 2] = (
            rng.uniform(-0.05, 0.05, size=raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
        )
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", raw.reshape(rows, -1), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = ours.open_reader(tmp_path / "k.gguf").tensors[0]
    values = ours._dequantize(tensor, tmp_path / "k.gguf")
    expected = np.array(
        [[v for b in range(cols // 256) for v in reference(raw[r, b].tobytes())] for r in range(rows)], dtype=np.float32
    )
    assert values.shape == (rows, cols)
    np.testing.assert_allclose(values, expected, rtol=1e-5, atol=1e-6)


# -- bad input -----------------------------------------------------------------------------------


def _minimal(path: Path, arch: str = "llama", tensor_type: Q = Q.F32, tokenizer: str = "gpt2") -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_embedding_length(32)
    writer.add_block_count(1)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list(["a", "b"])
    data = np.zeros((4, 32), dtype=np.float32)
    if tensor_type == Q.F32:
        writer.add_tensor("token_embd.weight", data)
    else:  # raw bytes of the right size for a type we do not read
        size = gguf.quants.quant_shape_to_byte_shape((4, 256), tensor_type)
        writer.add_tensor("token_embd.weight", np.zeros(size, dtype=np.uint8), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_truncated_or_corrupt_file(tmp_path, tokenizer_json):
    file, _ = tiny(tmp_path, tokenizer_json, "llama", "llama", [Q.Q8_0])
    data = file.read_bytes()
    for name, content in [
        ("truncated.gguf", data[: len(data) // 3]),
        ("header.gguf", data[:20]),
        ("garbage.gguf", b"not a gguf" * 50),
    ]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError, match="truncated or (not a GGUF|corrupt)|cannot|not a GGUF"):
            spec, _ = infer_checkpoint_spec(tmp_path / name)
            load_decoder(spec, tmp_path / name, TINY_MAX_SEQ)


def test_unsupported_architecture(tmp_path):
    with pytest.raises(
        CheckpointError,
        match=r"architecture 'mamba'.*supported: llama, smollm3, granite, olmo2, qwen2, qwen3, gemma3, phi3",
    ):
        ours.read_config(_minimal(tmp_path / "m.gguf", arch="mamba"))


def test_unsupported_tensor_type(tmp_path):
    file = _minimal(tmp_path / "iq.gguf", tensor_type=Q.IQ2_XXS)
    with pytest.raises(CheckpointError, match="token_embd.weight.*IQ2_XXS"):
        list(ours._dequantize(t, file) for t in ours.open_reader(file).tensors)


def test_unconvertible_vocabulary(tmp_path):
    with pytest.raises(CheckpointError, match="'bert' vocabulary"):
        gguf_vocab.checkpoint_folder(_minimal(tmp_path / "v.gguf", tokenizer="bert"))


def test_folder_with_two_ggufs(tmp_path):
    _minimal(tmp_path / "a.gguf")
    _minimal(tmp_path / "b.gguf")
    with pytest.raises(CheckpointError, match=r"several \.gguf files \(a\.gguf, b\.gguf\)"):
        infer_checkpoint_spec(tmp_path)


def test_cli_exports_and_runs_a_tiny_gguf(tmp_path, tokenizer_json, capsys):
    from genai_pipeline.cli import main

    file, _ = tiny(tmp_path, tokenizer_json, "llama", "llama", [Q.Q8_0, Q.Q4_0])
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 10)
    assert main(["export", "--checkpoint", str(tmp_path / "bad.gguf"), "--out", str(tmp_path / "x")]) == 2
    assert "error:" in capsys.readouterr().err
    out = tmp_path / "out"
    argv = ["export", "--checkpoint", str(file), "--mode", "kv", "--max-seq-len", str(TINY_MAX_SEQ), "--out", str(out)]
    assert main(argv) == 0
    assert (out / "tokenizer.json").is_file() and (out / "text_decoder.pte").is_file()
    # the converted metadata files travel with the program: the chat template, the end-of-turn ids
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"].startswith(
        "{% for m in messages %}"
    )
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0
    capsys.readouterr()
    assert main(["run", str(out), "--prompt", "The list object", "--max-new-tokens", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(result["tokens"]) == 4


# -- the real SmolLM2-135M-Instruct Q4_1 ---------------------------------------------------------

TEXTS = [
    "<|im_start|>user\nWhat is 2+2? Answer in 12345 words.<|im_end|>\n<|im_start|>assistant\n",
    "  Leading spaces,\ttabs and\n\nnewlines  ",
    "Ünïcödé: café, naïve, 日本語, emoji 🤖!",
    "digits 3.14159 and 1,000,000",
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2} is absent (make test fetches it)")
    return SMOLLM2


def test_smollm2_config(smollm2):
    spec, _ = infer_checkpoint_spec(smollm2)
    config = spec.config_from_checkpoint(ours.read_config(smollm2))
    assert (config.n_layers, config.dim, config.vocab_size, config.n_heads, config.n_kv_heads) == (30, 576, 49152, 9, 3)
    assert config.tie_embeddings and config.hidden_dim == 1536


def test_smollm2_greedy_tokens_match_transformers(smollm2):
    import transformers

    spec, _ = infer_checkpoint_spec(smollm2)
    decoder = load_decoder(spec, smollm2, 64)
    prompt = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    ids, logits, pos = [], decoder(torch.tensor([prompt]), torch.tensor([0]), last_only=True), len(prompt)
    with torch.no_grad():
        for _ in range(16):
            ids.append(int(logits.argmax(-1)))
            logits = decoder(torch.tensor([[ids[-1]]]), torch.tensor([pos]), last_only=True)
            pos += 1
    del decoder
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32
    )
    expected = []
    with torch.no_grad():  # greedy without generate(), which would stop at <|im_end|>
        for _ in range(16):
            expected.append(int(reference(torch.tensor([prompt + expected])).logits[0, -1].argmax()))
    assert ids == expected


def test_smollm2_tokenizer_matches_transformers_and_executorch(smollm2):
    import transformers
    from pytorch_tokenizers import CppHFTokenizer

    from genai_pipeline.tokenizer import Tokenizer

    folder = metadata_folder(smollm2)
    reference = transformers.AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)
    runtime = Tokenizer.from_folder(folder)
    cpp = CppHFTokenizer()
    cpp.load(str(folder / "tokenizer.json"))
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=False)
        assert runtime.encode(text, add_special_tokens=False) == expected, text
        assert cpp.encode(text, 0, 0) == expected, text
        assert runtime.decode(expected) == reference.decode(expected, skip_special_tokens=True)
    assert expected and "<|im_start|>" not in runtime.decode(runtime.encode(TEXTS[0]))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] == ours.open_reader(smollm2).fields["tokenizer.chat_template"].contents()
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)


def test_smollm2_loads_within_one_copy_of_the_weights(smollm2):
    """Peak RSS growth while loading stays under 1.3x the model's fp32 bytes (a second copy would be 2x;
    measured: 629 MiB for 513 MiB of weights)."""
    script = f"""
import resource, torch
from pathlib import Path
import executorch.extension.llm.custom_ops.custom_ops  # the KV cache's ops: imported by the first cache, ~135 MiB of code
from genai_pipeline.checkpoints import infer_checkpoint_spec, load_decoder
path = Path({str(smollm2)!r})
spec, _ = infer_checkpoint_spec(path)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
decoder = load_decoder(spec, path, 64)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
weights = sum(t.numel() * 4 for t in {{p.data_ptr(): p for p in decoder.parameters()}}.values())  # a tied head shares storage
print(after * 1024 - before * 1024, weights)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    grown, weights = map(int, result.stdout.split()[-2:])
    assert grown < 1.3 * weights, (grown / 2**20, weights / 2**20)
    # what is left beyond the weights is the memory-mapped file's pages (94 MiB) and one tensor at a time
    assert grown - smollm2.stat().st_size < 1.1 * weights, (grown / 2**20, weights / 2**20)


def test_a_q4_0_gguf_exported_as_8da4w_keeps_the_files_integers_and_scales(tmp_path, tokenizer_json):
    """The 8da4w grid (symmetric int4, one scale per 32 weights) is Q4_0's: the program holds the
    file's integers and scales, not a re-quantization of their dequantized values. XNNPACK takes
    positive bf16 scales only: a block with a negative scale is stored negated (its -8 becomes +7,
    the one value that moves) and fp16 scales round to bf16 (2^-9 at most)."""
    from genai_pipeline.cli import main
    from genai_pipeline.upstream.executorch_pte_reader import read_program

    file, _ = tiny(tmp_path, tokenizer_json, "llama", "llama", [Q.Q4_0])
    out = tmp_path / "q4_0"
    assert (
        main(
            [
                "export",
                "--checkpoint",
                str(file),
                "--recipe",
                "8da4w",
                "--mode",
                "kv",
                "--max-seq-len",
                "64",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    program, segment = read_program(out / "text_decoder.pte")
    blobs = {segment(entry.segment_index) for entry in program.named_data}
    file_weights = gguf_q4_0.read_q4_0(file)
    linears = [n for n in file_weights if n != "tok_embeddings.weight"]
    assert len(linears) == 15  # 2 layers x 7 linears + the untied head, all Q4_0
    moved, integers, scales = 0, {}, {}
    for name in linears:
        q, d = file_weights[name]
        negative = (d < 0).repeat_interleave(32, dim=1)
        stored = torch.where(negative, -q.to(torch.int16), q.to(torch.int16)).clamp(-8, 7).to(torch.int8)
        moved += int((stored != torch.where(negative, -q, q)).sum())
        u = (stored.to(torch.int16) + 8).to(torch.uint8).reshape(-1)
        integers[name] = (u[1::2] << 4 | u[::2]).numpy().tobytes()
        scales[name] = d.abs().to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    # The linears that read one input are stored as one weight, their rows one after another (fused
    # for XNNPACK: targets/xnnpack.py)
    groups = [[n] for n in linears if not re.search(r"\.(wq|wk|wv|w1|w3)\.", n)]
    for i in range(2):
        groups += [
            [f"layers.{i}.attention.{w}.weight" for w in ("wq", "wk", "wv")],
            [f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w3")],
        ]
    assert sorted(n for g in groups for n in g) == sorted(linears)
    for group in groups:
        assert b"".join(integers[n] for n in group) in blobs, f"{group}: not the file's integers"
        assert b"".join(scales[n] for n in group) in blobs, f"{group}: not the file's scales"
    total = sum(file_weights[n][0].numel() for n in linears)
    assert moved < total / 32  # at most the one -8 of each negative block
