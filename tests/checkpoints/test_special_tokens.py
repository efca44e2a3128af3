"""Special tokens come from the checkpoint; the registry entry fills only what it lacks."""

from __future__ import annotations

import json

from conftest import TINY_VOCAB, save_hf_checkpoint, train_tokenizer

from genai_pipeline.checkpoints.special_tokens import read_special_tokens
from genai_pipeline.options import PrepareOptions
from genai_pipeline.prepare import prepare
from genai_pipeline.registry import get_spec

CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def chat_checkpoint(folder, generation_eos=(2, 5), config_eos=2):
    """A tiny Llama whose files disagree as real ones do: generation_config lists two eos, config.json
    one, tokenizer_config.json names <|im_end|>, which the chat template closes each turn with."""
    from tokenizers import Tokenizer

    save_hf_checkpoint(folder, bos_token_id=1, eos_token_id=config_eos, pad_token_id=3)
    tok = Tokenizer.from_file(str(train_tokenizer(folder / "tokenizer.json", TINY_VOCAB - 2)))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": list(generation_eos)})
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    return folder, tok.token_to_id("<|im_end|>")


def test_every_eos_the_checkpoint_names_and_where_it_came_from(tmp_path):
    folder, im_end = chat_checkpoint(tmp_path)
    special = read_special_tokens(folder, CHATML, fallback_bos=0, fallback_eos=(0,))
    assert special.bos_id == 1 and special.pad_id == 3
    assert special.eos_ids == (2, 5, im_end)  # generation_config.json's first, then the others'
    assert special.end_of_turn_ids == (im_end,)
    assert special.sources["bos_id"] == ("generation_config.json",)
    assert special.sources["pad_id"] == ("config.json",)
    assert set(special.sources["eos_ids"]) == {
        "generation_config.json",
        "config.json",
        "tokenizer_config.json",
        "chat template (<|im_end|>)",
    }


def test_the_entry_fills_only_what_the_checkpoint_lacks(tmp_path):
    folder, _ = chat_checkpoint(tmp_path)
    for name in ("generation_config.json", "config.json", "tokenizer_config.json"):
        (folder / name).write_text("{}")
    special = read_special_tokens(folder, None, fallback_bos=7, fallback_eos=(8, 9))
    assert (special.bos_id, special.eos_ids) == (7, (8, 9))
    assert special.sources == {"bos_id": ("registry entry",), "eos_ids": ("registry entry",)}
    assert read_special_tokens(None, None, 7, (8,)).eos_ids == (8,)


def test_the_program_carries_the_checkpoints_ids_not_the_entrys(tmp_path):
    folder, im_end = chat_checkpoint(tmp_path)
    spec = get_spec("smollm2-135m")  # bos 0, eos (0,): what the entry would have said
    prepared = prepare(spec, PrepareOptions(mode="kv", max_seq_len=32, checkpoint=folder))
    constants = next(iter(prepared.artifacts.values())).constant_methods
    assert constants["get_bos_id"] == 1 and constants["get_eos_ids"] == [2, 5, im_end]
    assert prepared.spec.eos_ids == (2, 5, im_end) and prepared.special_tokens.pad_id == 3
    # A checkpoint of sizes no entry lists keeps its family but never another entry's name.
    assert prepared.spec.name == "llama (custom: 2 layers, dim 64)" and prepared.spec.entry == "smollm2-135m"
