"""Voxtral (`VoxtralForConditionalGeneration`): Whisper's encoder on 30 s chunks of 128-bin log-mel
features, four frames stacked into one token and projected by a linear-GeLU-linear connector into a
Llama text decoder (Ministral 3B's shape for Voxtral-Mini).

Why Voxtral for the speech path: transformers 5.25 ships it as one plain composition (a Whisper
encoder, a reshape, two linears, Llama), its encoder takes a fixed `[1, 128, 3000]` float chunk,
exactly what ExecuTorch 1.5.1's MultimodalRunner hands its `audio_encoder` method (float32
`[batch, n_bins, n_frames]`), and ExecuTorch's own Voxtral example targets that runner. Granite
Speech (also in transformers 5.25) needs a Conformer encoder with relative position bias and a
Q-Former projector over variable-length windows: two new block kinds and a dynamic-shape encoder.

The sizes of `voxtral-mini-3b` are those of mistralai/Voxtral-Mini-3B-2507's config.json as
recalled, not checked against the Hub here (no network): a checkpoint's own config.json wins.
The Hub repository carries Mistral's `tekken.json`, not a `tokenizer.json`, and no chat template:
export it from a folder holding a `tokenizer.json` converted from it and a chat template.
"""

from __future__ import annotations

from genai_pipeline.audio_processing import AudioProcessing
from genai_pipeline.models.audio import AudioConfig
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.registry.hf_config import unsupported
from genai_pipeline.registry.llama import config_from_hf
from genai_pipeline.registry.llava import TEXT_KEY_MAP
from genai_pipeline.registry.multimodal import AudioSpec
from genai_pipeline.registry.spec import ModelSpec

# VoxtralConfig's defaults for a text_config that leaves keys out (its `sub_configs_defaults`),
# over LlamaConfig's own (32 heads).
TEXT_DEFAULTS = {
    "model_type": "llama",
    "vocab_size": 131072,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 30,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000000.0,
    "head_dim": 128,
}
# VoxtralEncoderConfig's defaults (Whisper large-v3's encoder)
AUDIO_DEFAULTS = {
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "num_mel_bins": 128,
    "max_source_positions": 1500,
    "activation_function": "gelu",
    "scale_embedding": False,
}
AUDIO_TOKEN_ID = 24  # `[AUDIO]` in tekken.json (VoxtralProcessor's audio_token_id)

_TOWER = r"(?:model\.)?audio_tower\."
AUDIO_KEY_MAP: tuple[tuple[str, str], ...] = (
    (_TOWER + r"(conv[12]\.(?:weight|bias)|embed_positions\.weight|layer_norm\.(?:weight|bias))", r"audio.\1"),
    (
        _TOWER + r"layers\.(\d+)\.((?:self_attn\.(?:q|k|v|out)_proj|self_attn_layer_norm|final_layer_norm|fc[12])"
        r"\.(?:weight|bias))",
        r"audio.layers.\1.\2",
    ),
    (r"(?:model\.)?multi_modal_projector\.(linear_[12]\.weight)", r"audio.projector.\1"),
)


def text_config_from_hf(hf: dict) -> DecoderConfig:
    return config_from_hf({**TEXT_DEFAULTS, **(hf.get("text_config") or {})})


def audio_config_from_hf(hf: dict) -> AudioConfig:
    a = {**AUDIO_DEFAULTS, **(hf.get("audio_config") or {})}
    if a["activation_function"] != "gelu" or hf.get("projector_hidden_act", "gelu") != "gelu":
        raise unsupported(f"activations '{a['activation_function']}' / '{hf.get('projector_hidden_act')}' (GeLU only)")
    if a["scale_embedding"]:
        raise unsupported("scale_embedding in the audio encoder")
    dim, width = int(a["hidden_size"]), int(a["intermediate_size"])
    if width % dim:
        raise unsupported(f"an audio intermediate_size ({width}) that is no multiple of hidden_size ({dim})")
    return AudioConfig(
        n_mels=int(a["num_mel_bins"]),
        frames=2 * int(a["max_source_positions"]),
        dim=dim,
        n_layers=int(a["num_hidden_layers"]),
        n_heads=int(a["num_attention_heads"]),
        hidden_dim=width,  # Whisper's encoder_ffn_dim, which Voxtral's reshape also reads as 4 frames' width
        text_dim=int(text_config_from_hf(hf).dim),
        stack=width // dim,
    )


def chat_template() -> str:
    """mistral_common's Voxtral instruct format, for checkpoints without a template of their own:
    an audio part is `<audio>` (expanded to `[BEGIN_AUDIO]` and the audio tokens at run time)."""
    text = (
        "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
        "{% if c.type == 'audio' %}<audio>{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}"
    )
    return (
        "{{ bos_token }}{% for m in messages %}{% set text %}" + text + "{% endset %}"
        "{% if m.role == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
        "{% elif m.role == 'user' %}[INST]{{ text }}[/INST]"
        "{% elif m.role == 'assistant' %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
    )


def _spec(name: str, description: str, text: DecoderConfig, audio: AudioConfig) -> ModelSpec:
    return ModelSpec(
        name=name,
        family="voxtral",
        description=description,
        config=text,
        key_map=TEXT_KEY_MAP + AUDIO_KEY_MAP,
        config_from_checkpoint=text_config_from_hf,
        hf_model_types=("voxtral",),
        bos_id=1,
        eos_ids=(2,),
        chat_template=chat_template(),
        audio=AudioSpec(
            config=audio,
            config_from_checkpoint=audio_config_from_hf,
            preprocessing=AudioProcessing(tokens_per_chunk=audio.tokens_per_chunk),
            audio_token_id=AUDIO_TOKEN_ID,
        ),
    )


SPECS = (
    _spec(
        "voxtral-mini-3b",
        "mistralai/Voxtral-Mini-3B-2507 (sizes as recalled, unverified against the Hub)",
        text_config_from_hf({}),
        audio_config_from_hf({}),
    ),
)
