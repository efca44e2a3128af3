"""llama.cpp GGUF architectures as this pipeline reads them (gguf.py): tensor names, metadata keys,
and what llama.cpp's convert_hf_to_gguf.py changed, undone by gguf.py, per architecture (`ARCHS`):
- llama, smollm3, granite: the rows of q and k (weights and biases) are permuted per head from
  Hugging Face's rotate-half RoPE order to the interleaved order of llama.cpp's RoPE; undone with
  the inverse permutation. qwen2, qwen3, gemma3, phi3 and olmo2 use llama.cpp's NEOX (rotate-half)
  RoPE and are stored unpermuted.
- smollm3: nothing says which layers go without RoPE; llama.cpp takes every 4th, as transformers'
  default does when config.json lists none.
- granite: its four multipliers are metadata named as scales (`GRANITE_KEYS`).
- olmo2: no norm before attention and MLP, post_attention_norm and post_ffw_norm after them, and
  q/k norms over the whole projection: the tensors line up with ours by name.
- gemma3: every `*norm.weight` is stored with 1 added (Gemma's RMSNorm scales by 1 + weight and
  llama.cpp's by weight); our decoder applies 1 + weight itself, so 1 is subtracted.
- phi3: q/k/v are one `attn_qkv` tensor and gate/up one `ffn_up` tensor, as in Hugging Face's
  Phi-3; split along the output dim as `hf.py` splits them.
- lfm2: the KV head count is written per layer, 0 for a short-convolution layer (which gives the
  layer kinds); the final norm is `token_embd_norm` (Hugging Face's `embedding_norm`); the
  convolution's weight is stored without its unit middle dimension; the MLP width is the one the
  model uses (transformers' adjustment already applied).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# GGUF tensor names -> ours (one or several for a fused tensor), first match wins. Gemma's norms
# line up with ours by name: attn_norm before attention, post_attention_norm after it, ffn_norm
# before the MLP, post_ffw_norm after it.
TENSOR_MAP: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"token_embd\.weight", ("tok_embeddings.weight",)),
    (r"output_norm\.weight", ("norm.weight",)),
    (r"output\.weight", ("output.weight",)),
    (r"blk\.(\d+)\.attn_norm\.weight", (r"layers.\1.attention_norm.weight",)),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", (r"layers.\1.attention.wq.\2",)),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", (r"layers.\1.attention.wk.\2",)),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", (r"layers.\1.attention.wv.\2",)),
    (
        r"blk\.(\d+)\.attn_qkv\.weight",
        (r"layers.\1.attention.wq.weight", r"layers.\1.attention.wk.weight", r"layers.\1.attention.wv.weight"),
    ),
    (r"blk\.(\d+)\.attn_output\.weight", (r"layers.\1.attention.wo.weight",)),
    (r"blk\.(\d+)\.attn_q_norm\.weight", (r"layers.\1.attention.q_norm.weight",)),
    (r"blk\.(\d+)\.attn_k_norm\.weight", (r"layers.\1.attention.k_norm.weight",)),
    (r"blk\.(\d+)\.post_attention_norm\.weight", (r"layers.\1.attention_post_norm.weight",)),
    (r"blk\.(\d+)\.ffn_norm\.weight", (r"layers.\1.ffn_norm.weight",)),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", (r"layers.\1.ffn_post_norm.weight",)),
    (r"blk\.(\d+)\.ffn_gate\.weight", (r"layers.\1.feed_forward.w1.weight",)),
    (r"blk\.(\d+)\.ffn_down\.weight", (r"layers.\1.feed_forward.w2.weight",)),
    (r"blk\.(\d+)\.ffn_up\.weight", (r"layers.\1.feed_forward.w3.weight",)),
)
# Phi-3's ffn_up is gate and up fused ([gate; up], as Hugging Face's gate_up_proj).
PHI3_TENSOR_MAP = (
    (r"blk\.(\d+)\.ffn_up\.weight", (r"layers.\1.feed_forward.w1.weight", r"layers.\1.feed_forward.w3.weight")),
)
# LFM2's own tensor names (llama.cpp's `shortconv.*`; no output_norm: token_embd_norm is the final norm).
LFM2_TENSOR_MAP = (
    (r"token_embd_norm\.weight", ("norm.weight",)),
    (r"blk\.(\d+)\.shortconv\.conv\.weight", (r"layers.\1.conv.conv_weight",)),
    (r"blk\.(\d+)\.shortconv\.in_proj\.weight", (r"layers.\1.conv.in_proj.weight",)),
    (r"blk\.(\d+)\.shortconv\.out_proj\.weight", (r"layers.\1.conv.out_proj.weight",)),
)
# Tensors llama.cpp derives from the config (RoPE frequency factors); our decoder computes its own.
DERIVED_TENSORS = re.compile(r"rope_freqs\.weight|rope_factors_(long|short)\.weight")

# Types we dequantize (through `gguf.quants.dequantize`, which implements each of them).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


@dataclass(frozen=True)
class Arch:
    """What an architecture's GGUF needs: its config.json `model_type`, whether llama.cpp permuted
    q/k rows, what it added to the norm weights, its own tensor names (first), config defaults."""

    model_type: str
    permuted_qk: bool = False
    norm_shift: float = 0.0
    tensor_map: tuple[tuple[str, tuple[str, ...]], ...] = ()
    defaults: tuple[tuple[str, object], ...] = ()
    config_keys: tuple[tuple[str, str], ...] = ()  # its own `{arch}.` metadata keys -> config.json keys

    def map_tensor(self, name: str) -> tuple[str, ...]:
        for pattern, replacements in self.tensor_map + TENSOR_MAP:
            if re.fullmatch(pattern, name):
                return tuple(re.sub(pattern, r, name) for r in replacements)
        return ()


# Granite's multipliers, which llama.cpp's converter writes as scales (logits are divided by logit_scale).
GRANITE_KEYS = (
    ("embedding_scale", "embedding_multiplier"),
    ("residual_scale", "residual_multiplier"),
    ("attention.scale", "attention_multiplier"),
    ("logit_scale", "logits_scaling"),
)

ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", permuted_qk=True),
    "smollm3": Arch("smollm3", permuted_qk=True),
    "granite": Arch("granite", permuted_qk=True, config_keys=GRANITE_KEYS),
    "olmo2": Arch("olmo2"),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3"),
    # Gemma 3: llama.cpp fixes what the GGUF leaves out: GeGLU, 5 of 6 layers sliding with a RoPE
    # base of 10000, query_pre_attn_scalar = head_dim (but 27B); see _gemma3_config.
    "gemma3": Arch("gemma3_text", norm_shift=1.0, defaults=(("hidden_activation", "gelu_pytorch_tanh"),)),
    "phi3": Arch("phi3", tensor_map=PHI3_TENSOR_MAP),
    "lfm2": Arch("lfm2", tensor_map=LFM2_TENSOR_MAP, config_keys=(("shortconv.l_cache", "conv_L_cache"),)),
}

# GGUF `{arch}.` metadata keys -> config.json keys, every architecture.
CONFIG_KEYS = {
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
    "attention.sliding_window": "sliding_window",
}
# tokenizer.ggml.* ids -> generation/config keys
TOKEN_ID_KEYS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "padding_token_id": "pad_token_id"}
