"""render_sample: text encoded with the tokenizer's special tokens; chats through a real Jinja template."""

import json

import pytest
from conftest import train_tokenizer

from genai_pipeline.chat_template import ChatTemplate, read_chat_template, render_chat
from genai_pipeline.data import ContentPart, Message, Sample, render_sample
from genai_pipeline.errors import DataError
from genai_pipeline.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Indented block tags: only trim_blocks + lstrip_blocks keep their whitespace out of the output.
LLAMA2 = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'user' %}
[INST] {{ message['content'] }} [/INST]
    {% else %}
 {{ message['content'] }}{{ eos_token }}
    {% endif %}
{% endfor %}
"""
CHAT = Sample(
    messages=(Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello!")),
    origin="chat.json sample 0",
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer(train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", 300))


def test_text_is_encoded_with_the_tokenizers_special_tokens(tokenizer):
    ids = render_sample(Sample(text="the list object"), tokenizer, CHATML)
    assert ids == tokenizer.encode("the list object") and ids[0] == 0  # BOS from the post-processor


def test_chatml_template(tokenizer):
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )
    assert render_chat(CHAT.messages, CHATML) == expected
    ids = render_sample(CHAT, tokenizer, CHATML)
    assert ids == tokenizer.encode(expected, add_special_tokens=False) and ids[0] != 0  # no BOS added again


def test_whitespace_control_and_special_token_strings(tokenizer):
    messages = (Message("user", "Hi"), Message("assistant", "Hello!"))
    text = render_chat(messages, LLAMA2, bos_token="<s>", eos_token="</s>")
    assert text == "<s>\n[INST] Hi [/INST]\n Hello!</s>\n"


def test_fallback_without_a_template(tokenizer):
    assert render_chat(CHAT.messages, None) == "system: Be brief.\nuser: Hi\nassistant: Hello!\n"
    assert render_sample(CHAT, tokenizer, None) == tokenizer.encode("system: Be brief.\nuser: Hi\nassistant: Hello!\n")


def test_image_parts_reach_the_template(tmp_path):
    template = (
        "{% for m in messages %}{{ m.role }}:{% for p in m.content %}"
        "{% if p.type == 'image' %}<image>{% else %} {{ p.text }}{% endif %}{% endfor %}{{ '\\n' }}{% endfor %}"
    )
    content = (ContentPart("image", image=tmp_path / "cat.png"), ContentPart("text", text="What is it?"))
    messages = (Message("user", content),)
    assert render_chat(messages, template) == "user:<image> What is it?\n"
    assert render_chat(messages, None) == "user: What is it?\n"


def test_template_errors_name_the_sample(tokenizer):
    with pytest.raises(DataError, match="does not parse"):
        render_sample(CHAT, tokenizer, "{% for m in messages %}")
    raising = "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    with pytest.raises(DataError) as e:
        render_sample(CHAT, tokenizer, raising)
    assert "chat.json sample 0" in str(e.value) and "System role not supported" in str(e.value)


def test_template_runs_in_a_sandbox(tokenizer):
    with pytest.raises(DataError, match="fails"):
        render_sample(CHAT, tokenizer, "{{ messages.append(1) }}")


def test_read_chat_template_from_tokenizer_config(tmp_path):
    config = {"chat_template": CHATML, "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert read_chat_template(tmp_path) == ChatTemplate(CHATML, "<s>", "</s>")
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": LLAMA2}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert read_chat_template(tmp_path).source == LLAMA2
    (tmp_path / "chat_template.jinja").write_text(CHATML)  # the newer file wins
    assert read_chat_template(tmp_path).source == CHATML


def test_a_processors_template_comes_before_the_tokenizers(tmp_path):
    """A vision-language processor's template (SmolVLM: processor_config.json; older processors:
    chat_template.json) is the one that places images; chat_template.jinja still wins."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA2, "eos_token": "</s>"}))
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_len": 64, "chat_template": "processor"}))
    template = read_chat_template(tmp_path)
    assert (template.source, template.eos_token, template.origin) == (
        "processor",
        "</s>",
        str(tmp_path / "processor_config.json"),
    )
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "legacy processor"}))
    assert read_chat_template(tmp_path).source == "legacy processor"
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    assert read_chat_template(tmp_path).source == CHATML


def test_no_chat_template(tmp_path):
    assert read_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text("{broken")
    with pytest.raises(DataError, match="tokenizer_config.json' is not valid JSON"):
        read_chat_template(tmp_path)


# Whitespace control around indented tags, a namespace, loop controls, the {% generation %} tag and tojson.
RICH = """{%- set ns = namespace(turns=0) %}
{% for message in messages %}
    {% set ns.turns = ns.turns + 1 %}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] | tojson }}{% endgeneration %}
    {% else %}
{{ bos_token }}{{ message['role'] }} {{ ns.turns }}: {{ message['content'] }}
    {% endif %}
    {% if loop.index >= 4 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"""


@pytest.mark.parametrize("template", [CHATML, LLAMA2, RICH], ids=["chatml", "llama2", "rich"])
def test_rendering_matches_transformers(template):
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = (
        Message("user", "Is <a & b> 'true'?"),
        Message("assistant", 'Yes: "ünïcode".'),
        Message("user", "Why?"),
        Message("assistant", "Because."),
        Message("user", "Past the break"),
    )
    for add_generation_prompt in (False, True):
        ours = render_chat(
            messages, template, bos_token="<s>", eos_token="</s>", add_generation_prompt=add_generation_prompt
        )
        (theirs,), _ = render_jinja_template(
            [[{"role": m.role, "content": m.content} for m in messages]],
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            bos_token="<s>",
            eos_token="</s>",
        )
        assert ours == theirs
    if template == RICH:  # Hugging Face's tojson: neither HTML escapes nor \u escapes
        assert ours == '<s>user 1: Is <a & b> \'true\'?\n"Yes: \\"ünïcode\\"."<s>user 3: Why?\n"Because."assistant:'


def test_special_tokens_map_fills_a_legacy_tokenizer_config(tmp_path):
    config = {"chat_template": CHATML, "bos_token": "<s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": {"content": "<|begin|>"}, "eos_token": "<|end|>"})
    )
    assert read_chat_template(tmp_path) == ChatTemplate(CHATML, "<|begin|>", "<|end|>")
    # with added_tokens_decoder, tokenizer_config.json is the whole story (transformers ignores the map)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "added_tokens_decoder": {}}))
    assert read_chat_template(tmp_path) == ChatTemplate(CHATML, "<s>", None)
