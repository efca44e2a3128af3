"""Chat templates that stand in for a checkpoint without one (Jinja, rendered as Hugging Face
renders `chat_template`). A checkpoint's own template, from tokenizer_config.json or
chat_template.jinja, always wins; these carry each format's turn markers and nothing more
(no tool calls, no default system message)."""

LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Qwen2.5, Qwen3, SmolLM2, SmolLM3
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# LFM2: ChatML after the BOS (<|startoftext|>).
LFM2 = "{{- bos_token }}" + CHATML

# Gemma has no system role: a system message opens the first user turn.
GEMMA = (
    "{{- bos_token }}"
    "{%- set system = messages[0]['content'] + '\\n\\n' if messages and messages[0]['role'] == 'system' else '' %}"
    "{%- for message in messages if message['role'] != 'system' %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (system if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

# Gemma 3 with images (as google's gemma-3-*-it template): an image part is written `<start_of_image>`,
# which the processor expands; text parts trimmed, the system message (before the first user turn) not.
GEMMA_VISION = (
    "{{- bos_token }}"
    "{%- macro content(c) %}{%- if c is string %}{{- c | trim }}{%- else %}{%- for part in c %}"
    "{{- '<start_of_image>' if part['type'] == 'image' else part['text'] | trim }}{%- endfor %}{%- endif %}{%- endmacro %}"
    "{%- set first = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none %}"
    "{%- set system = (first if first is string else first[0]['text']) + '\\n\\n' if first is not none else '' %}"
    "{%- for message in messages if message['role'] != 'system' %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (system if loop.first else '') + content(message['content']) + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

PHI = (
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)

# Granite 3.x: roles between <|start_of_role|> and <|end_of_role|>, every turn ended by <|end_of_text|>.
GRANITE = (
    "{%- for message in messages %}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
)

# OLMo 2 Instruct (Tulu 3's format): <|system|>, <|user|>, <|assistant|> lines; an answer ends with EOS.
TULU = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{%- else %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

# Mistral: [INST] ... [/INST] around each user turn (a system message opens the first one); an
# answer ends with EOS. The [/INST] of the last user turn already opens the assistant's turn.
MISTRAL = (
    "{{- bos_token }}"
    "{%- set system = messages[0]['content'] + '\\n\\n' if messages and messages[0]['role'] == 'system' else '' %}"
    "{%- for message in messages if message['role'] != 'system' %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{%- else %}"
    "{{- message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)

# The shipped reference-vlm's own format (tools/train_reference_vlm.py): BOS, the image, the question;
# the answer follows with a space, then EOS, and a later question goes on after it. It has no system
# role and no turn markers: a system message is left out.
QUESTION_ANSWER = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set parts = [{'type': 'text', 'text': message['content']}] if message['content'] is string else message['content'] %}"
    "{%- if message['role'] == 'user' %}"
    "{%- for part in parts %}{{- '<image>' if part['type'] == 'image' else part['text'] }}{%- endfor %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- for part in parts if part['type'] == 'text' %}{{- part['text'] }}{%- endfor %}{{- eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)
