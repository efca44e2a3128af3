"""The model zoo: every entry's embedded config against the public model it names.

HUB_CONFIGS holds the architecture fields of each model's public config.json, spelled as the
Hub's files spell them (transformers 4.x layout). Each must read (config_from_hf) into exactly
the embedded config, and `infer_spec` must pick the entry from it.
"""

from pathlib import Path

import pytest
import torch

from genai_pipeline.errors import CheckpointError
from genai_pipeline.models.decoder import Decoder
from genai_pipeline.registry import SPECS, chat_templates, get_spec, infer_spec

# Public parameter counts (model cards / papers). Qwen3-1.7B: 1.72 B with its tied embedding;
# the Hub page's 2.03 B also counts the lm_head copy stored in its safetensors.
PUBLIC_PARAMS = {
    "llama3_2-1b": 1.24e9,
    "llama3_2-3b": 3.21e9,
    "llama3_1-8b": 8.03e9,
    "qwen2_5-0_5b": 494e6,
    "qwen2_5-1_5b": 1.54e9,
    "qwen3-0_6b": 596e6,
    "qwen3-1_7b": 1.72e9,
    "qwen3-4b": 4.02e9,
    "smollm2-135m": 135e6,
    "smollm2-360m": 362e6,
    "smollm2-1_7b": 1.71e9,
    "smollm3-3b": 3.08e9,
    "phi_4_mini": 3.84e9,
    "gemma3-1b": 1.0e9,
    "granite3_3-2b": 2.53e9,
    "olmo2-1b": 1.48e9,
    "mistral-7b-v0_3": 7.25e9,
    "ministral-8b": 8.02e9,
    "lfm2-350m": 354e6,
}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA = dict(model_type="llama", hidden_act="silu", attention_bias=False, mlp_bias=False)
QWEN2 = dict(
    model_type="qwen2",
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    vocab_size=151936,
    use_sliding_window=False,
    tie_word_embeddings=True,
)
QWEN3 = dict(
    model_type="qwen3",
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=1000000,
    rope_scaling=None,
    vocab_size=151936,
    head_dim=128,
    max_position_embeddings=40960,
    use_sliding_window=False,
    sliding_window=None,
    attention_bias=False,
    tie_word_embeddings=True,
)
SMOLLM2 = dict(
    LLAMA,
    vocab_size=49152,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_scaling=None,
    tie_word_embeddings=True,
)
PHI4_LONG_FACTOR = [
    1,
    1.118320672,
    1.250641126,
    1.398617824,
    1.564103225,
    1.74916897,
    1.956131817,
    2.187582649,
    2.446418898,
    2.735880826,
    3.059592084,
    3.421605075,
    3.826451687,
    4.279200023,
    4.785517845,
    5.351743533,
    5.984965424,
    6.693110555,
    7.485043894,
    8.370679318,
    9.36110372,
    10.4687158,
    11.70738129,
    13.09260651,
    14.64173252,
    16.37415215,
    18.31155283,
    20.47818807,
    22.90118105,
    25.61086418,
    28.64115884,
    32.03,
    32.1,
    32.13,
    32.23,
    32.6,
    32.61,
    32.64,
    32.66,
    32.7,
    32.71,
    32.93,
    32.97,
    33.28,
    33.49,
    33.5,
    44.16,
    47.77,
]

HUB_CONFIGS = {
    "llama3_2-1b": dict(
        LLAMA,
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "llama3_2-3b": dict(
        LLAMA,
        vocab_size=128256,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    "llama3_1-8b": dict(
        LLAMA,
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={**LLAMA3_ROPE, "factor": 8.0},
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        SMOLLM2,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        rope_theta=100000,
    ),
    "smollm2-360m": dict(
        SMOLLM2,
        hidden_size=960,
        intermediate_size=2560,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
        rope_theta=100000,
    ),
    "smollm2-1_7b": dict(
        SMOLLM2,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=24,
        num_attention_heads=32,
        num_key_value_heads=32,
        rope_theta=130000,
    ),
    "qwen2_5-0_5b": dict(
        QWEN2,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        sliding_window=32768,
        max_window_layers=24,
    ),
    "qwen2_5-1_5b": dict(
        QWEN2,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        sliding_window=131072,
        max_window_layers=28,
    ),
    "qwen3-0_6b": dict(
        QWEN3,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
    ),
    "qwen3-1_7b": dict(
        QWEN3,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
    ),
    "qwen3-4b": dict(
        QWEN3,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "smollm3-3b": dict(
        model_type="smollm3",
        hidden_act="silu",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=4,
        rms_norm_eps=1e-6,
        rope_theta=5000000.0,
        rope_scaling=None,
        max_position_embeddings=65536,
        no_rope_layer_interval=4,
        no_rope_layers=[1, 1, 1, 0] * 9,
        use_sliding_window=False,
        sliding_window=None,
        attention_bias=False,
        tie_word_embeddings=True,
    ),
    "phi_4_mini": dict(
        model_type="phi3",
        hidden_act="silu",
        vocab_size=200064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=24,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        partial_rotary_factor=0.75,
        rope_theta=10000.0,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        sliding_window=262144,
        attention_bias=False,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": PHI4_LONG_FACTOR},
        tie_word_embeddings=True,
    ),
    "gemma3-1b": dict(
        model_type="gemma3_text",
        hidden_activation="gelu_pytorch_tanh",
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        rms_norm_eps=1e-6,
        rope_theta=1000000,
        rope_local_base_freq=10000,
        rope_scaling=None,
        sliding_window=512,
        sliding_window_pattern=6,
        query_pre_attn_scalar=256,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        max_position_embeddings=32768,
        attention_bias=False,
    ),
    "granite3_3-2b": dict(
        model_type="granite",
        hidden_act="silu",
        vocab_size=49159,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=10000000.0,
        rope_scaling=None,
        max_position_embeddings=131072,
        attention_bias=False,
        mlp_bias=False,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.015625,
        logits_scaling=8.0,
        tie_word_embeddings=True,
    ),
    "olmo2-1b": dict(
        model_type="olmo2",
        hidden_act="silu",
        vocab_size=100352,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        rms_norm_eps=1e-6,
        rope_theta=500000,
        rope_scaling=None,
        max_position_embeddings=4096,
        attention_bias=False,
        tie_word_embeddings=False,
    ),
    "mistral-7b-v0_3": dict(
        model_type="mistral",
        hidden_act="silu",
        vocab_size=32768,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    "ministral-8b": dict(
        model_type="mistral",
        hidden_act="silu",
        vocab_size=131072,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=100000000.0,
        max_position_embeddings=32768,
        sliding_window=32768,
        tie_word_embeddings=False,
    ),
    "lfm2-350m": dict(
        model_type="lfm2",
        vocab_size=65536,
        hidden_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        block_ff_dim=6656,
        block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.0,
        block_multiple_of=256,
        conv_L_cache=3,
        conv_bias=False,
        full_attn_idxs=[2, 5, 8, 10, 12, 14],
        norm_eps=1e-5,
        rope_theta=1000000.0,
        max_position_embeddings=128000,
        tie_embedding=True,
    ),
}

ZOO = sorted(PUBLIC_PARAMS)


def test_the_zoo_is_complete_and_names_are_unique():
    assert set(ZOO) <= set(SPECS) and set(HUB_CONFIGS) == set(ZOO)
    names = [spec.name for spec in SPECS.values()]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", ZOO)
def test_embedded_config_has_the_public_parameter_count(name):
    config = get_spec(name).config
    with torch.device("meta"):
        model = Decoder(config, max_seq_len=128)
    # A tied head is the embedding's storage under a parameter of its own: counted once.
    count = sum(p.numel() for n, p in model.named_parameters() if not (config.tie_embeddings and n == "output.weight"))
    assert count == config.num_params
    assert abs(count / PUBLIC_PARAMS[name] - 1) < 0.03, f"{count / 1e9:.3f} B"


@pytest.mark.parametrize("name", ZOO)
def test_public_config_reads_into_the_embedded_one(name):
    spec = get_spec(name)
    assert spec.config_from_checkpoint(HUB_CONFIGS[name]) == spec.config
    assert infer_spec(HUB_CONFIGS[name]) is spec


def test_every_family_reads_a_model_type():
    families = {spec.family: spec.hf_model_types for spec in SPECS.values() if spec.checkpoint_format == "hf"}
    assert families == {
        "llama": ("llama",),
        "qwen2": ("qwen2",),
        "qwen3": ("qwen3",),
        "smollm3": ("smollm3",),
        "phi3": ("phi3",),
        "gemma3": ("gemma3_text",),
        "granite": ("granite",),
        "olmo2": ("olmo2",),
        "mistral": ("mistral", "ministral"),
        "lfm2": ("lfm2",),
        "smolvlm": ("idefics3", "smolvlm"),
        "llava": ("llava",),
        "internvl": ("internvl",),
        "gemma3-vision": ("gemma3",),
        "voxtral": ("voxtral",),
    }


UNSUPPORTED = {
    "yarn": ("qwen3-0_6b", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "RoPE scaling 'yarn'"),
    "attn-softcap": ("gemma3-1b", dict(attn_logit_softcapping=50.0), "softcapping"),
    "activation": ("llama3_2-1b", dict(hidden_act="relu"), "activation 'relu'"),
    "window-without-layer-types": ("qwen2_5-0_5b", dict(use_sliding_window=True), "layer_types"),
    "conv-bias": ("lfm2-350m", dict(conv_bias=True), "conv_bias"),
    "olmo3-window": ("olmo2-1b", dict(sliding_window=4096), "sliding window"),
}


@pytest.mark.parametrize("case", UNSUPPORTED.values(), ids=UNSUPPORTED.keys())
def test_unsupported_features_are_refused_by_name(case):
    name, change, message = case
    with pytest.raises(CheckpointError, match=message):
        get_spec(name).config_from_checkpoint({**HUB_CONFIGS[name], **change})


def test_sliding_window_layers_and_local_rope_of_gemma3():
    config = get_spec("gemma3-1b").config
    assert [i for i in range(26) if i not in config.sliding_window_layers] == [5, 11, 17, 23]
    assert [config.layer_rope(i) for i in (0, 5)] == ["local", "global"]
    assert config.rope_local_theta == 10000.0 and config.rope_theta == 1e6


def test_smollm3_skips_rope_in_every_fourth_layer():
    config = get_spec("smollm3-3b").config
    assert config.nope_layers == (3, 7, 11, 15, 19, 23, 27, 31, 35)
    without_list = {k: v for k, v in HUB_CONFIGS["smollm3-3b"].items() if k != "no_rope_layers"}
    assert get_spec("smollm3-3b").config_from_checkpoint(without_list) == config  # transformers' default pattern


def test_granite_reads_its_four_multipliers():
    config = get_spec("granite3_3-2b").config
    assert (config.embedding_multiplier, config.residual_multiplier) == (12.0, 0.22)
    assert (config.attention_scale, config.logit_divisor) == (0.015625, 8.0)


def test_olmo2_norms_come_after_attention_and_mlp_and_span_all_heads():
    config = get_spec("olmo2-1b").config
    assert (config.pre_norms, config.sandwich_norms, config.qk_norm, config.qk_norm_across_heads) == (
        False,
        True,
        True,
        True,
    )


def test_lfm2_convolution_layers_and_mlp_width():
    config = get_spec("lfm2-350m").config
    assert [i for i in range(16) if i not in config.conv_layers] == [2, 5, 8, 10, 12, 14]
    assert config.hidden_dim == 4608  # 6656 * 2 / 3, rounded up to a multiple of 256
    assert [config.layer_rope(i) for i in (0, 2)] == [None, "global"]
    # the 5.x layout: layer_types and intermediate_size (transformers' save_pretrained)
    hub = {k: v for k, v in HUB_CONFIGS["lfm2-350m"].items() if k not in ("full_attn_idxs", "block_ff_dim")}
    kinds = ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)]
    assert (
        get_spec("lfm2-350m").config_from_checkpoint({**hub, "layer_types": kinds, "intermediate_size": 6656}) == config
    )


@pytest.mark.parametrize(
    "change, window, layers",
    [
        (dict(sliding_window=None), None, ()),  # v0.2, v0.3
        (dict(sliding_window=4096), 4096, tuple(range(32))),  # v0.1: every layer
        ({}, 4096, tuple(range(32))),  # no key: transformers' MistralConfig default
        (  # Ministral: the sliding layers named
            dict(model_type="ministral", sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 16),
            64,
            tuple(range(0, 32, 2)),
        ),
    ],
    ids=["none", "every-layer", "default", "ministral-layer-types"],
)
def test_mistral_slides_where_the_config_has_a_window(change, window, layers):
    hub = {k: v for k, v in HUB_CONFIGS["mistral-7b-v0_3"].items() if k != "sliding_window"}
    config = get_spec("mistral-7b-v0_3").config_from_checkpoint({**hub, **change})
    assert (config.sliding_window, config.sliding_window_layers) == (window, layers)


# Chat formats: every message in order, and a generation prompt that opens the assistant's turn.
# reference-vlm's template is its training format instead (below).
CHAT_ENTRIES = [s for s in SPECS.values() if s.chat_template and s.chat_template != chat_templates.QUESTION_ANSWER]


def test_chat_models_carry_a_fallback_template():
    assert {s.family for s in CHAT_ENTRIES} >= {
        "llama",
        "qwen2",
        "qwen3",
        "smollm3",
        "phi3",
        "gemma3",
        "granite",
        "olmo2",
        "mistral",
        "lfm2",
    }


# Formats whose user turn ends in the marker that opens the answer: the generation prompt adds nothing.
OPEN_AFTER_USER = (chat_templates.MISTRAL, get_spec("voxtral-mini-3b").chat_template)


@pytest.mark.parametrize("spec", CHAT_ENTRIES, ids=lambda s: s.name)
def test_fallback_templates_render_every_turn_as_transformers_does(spec):
    from transformers.utils.chat_template_utils import render_jinja_template

    from genai_pipeline.chat_template import render_chat
    from genai_pipeline.messages import Message

    messages = (
        Message("system", "Be brief."),
        Message("user", "Hi there"),
        Message("assistant", "Hello."),
        Message("user", "Bye"),
    )
    rendered = {}
    for add_generation_prompt in (False, True):
        ours = render_chat(
            messages, spec.chat_template, bos_token="<s>", eos_token="</s>", add_generation_prompt=add_generation_prompt
        )
        (theirs,), _ = render_jinja_template(
            [[{"role": m.role, "content": m.content} for m in messages]],
            chat_template=spec.chat_template,
            add_generation_prompt=add_generation_prompt,
            bos_token="<s>",
            eos_token="</s>",
        )
        assert ours == theirs
        rendered[add_generation_prompt] = ours
    positions = [rendered[False].index(m.content) for m in messages]
    assert positions == sorted(positions)  # every message, in order
    prompt = rendered[True]
    assert prompt.startswith(rendered[False])
    if spec.chat_template in OPEN_AFTER_USER:
        assert prompt.endswith("[/INST]")  # the last user turn opened the assistant's
    else:
        assert len(prompt) > len(rendered[False])  # opens the assistant's turn


def test_reference_vlms_template_renders_its_training_prompt_as_transformers_does():
    """BOS, the image, the question; an answer follows with its EOS, then the next question. No
    system role (left out) and no generation prompt: the answer follows the question directly."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from genai_pipeline.chat_template import render_chat
    from genai_pipeline.messages import ContentPart, Message

    template = get_spec("reference-vlm").chat_template
    assert template == chat_templates.QUESTION_ANSWER
    image = ContentPart("image", image=Path("shapes.png"))
    messages = (
        Message("system", "Be brief."),
        Message("user", (image, ContentPart("text", text="What colour is the star?"))),
        Message("assistant", " red"),
        Message("user", "What shape is blue?"),
    )
    specials = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    ours = render_chat(messages, template, add_generation_prompt=True, **specials)
    assert ours == "<|endoftext|><image>What colour is the star? red<|endoftext|>What shape is blue?"
    as_json = [
        {
            "role": m.role,
            "content": m.content
            if isinstance(m.content, str)
            else [{"type": "image"} if p.type == "image" else {"type": "text", "text": p.text} for p in m.content],
        }
        for m in messages
    ]
    (theirs,), _ = render_jinja_template([as_json], chat_template=template, add_generation_prompt=True, **specials)
    assert ours == theirs


def test_an_unknown_model_type_names_the_closest_supported_ones():
    from genai_pipeline.errors import UnknownModelError

    with pytest.raises(UnknownModelError, match=r"'qwen2_moe'; closest: qwen2.*; supported: .*llama"):
        infer_spec({"model_type": "qwen2_moe"})
