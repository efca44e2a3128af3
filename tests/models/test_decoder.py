"""Our eager decoder against transformers' reference models, loaded through our HF loader."""

import pytest
import torch

from conftest import TINY_VOCAB, save_hf_checkpoint
from genai_pipeline.checkpoints.hf import load_decoder
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.registry import get_spec


def _compare_with_transformers(folder, spec_name, prefill=16, steps=8):
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ours = load_decoder(get_spec(spec_name), folder, max_seq_len=64)
    ids = torch.randint(0, TINY_VOCAB, (1, prefill + steps), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits[0]
        got = [ours(ids[:, :prefill], torch.tensor([0]))[0]]
        for i in range(prefill, prefill + steps):
            got.append(ours(ids[:, i : i + 1], torch.tensor([i]))[0])
    got = torch.cat(got)
    assert expected.abs().max() > 0.5, "logits too flat to make the comparison meaningful"
    assert (got - expected).abs().max().item() <= 1e-4


def test_llama_matches_transformers(tiny_checkpoint):
    """GQA, Llama-3 RoPE scaling, untied head: 16-token prefill then 8 decode steps."""
    _compare_with_transformers(tiny_checkpoint, "smollm2-135m")


def test_llama_tied_embeddings_match_transformers(tmp_path):
    save_hf_checkpoint(tmp_path, tie_word_embeddings=True, num_key_value_heads=4)
    _compare_with_transformers(tmp_path, "smollm2-135m")


def test_qkv_bias_matches_transformers_qwen2(tmp_path):
    save_hf_checkpoint(tmp_path, model_type="qwen2")
    _compare_with_transformers(tmp_path, "qwen2_5-0_5b")


def test_qk_norm_matches_transformers_qwen3(tmp_path):
    save_hf_checkpoint(tmp_path, model_type="qwen3", head_dim=32)
    _compare_with_transformers(tmp_path, "qwen3-0_6b")


def test_last_only_equals_last_row_of_all_positions(tiny_eager):
    model = tiny_eager()
    ids = torch.randint(0, TINY_VOCAB, (1, 11))
    with torch.no_grad():
        full = model(ids, torch.tensor([0]))
        model.reset_buffers()
        last = model(ids, torch.tensor([0]), last_only=True)
    torch.testing.assert_close(last, full[:, -1])


@pytest.mark.parametrize(
    "bad", [dict(n_heads=6, n_kv_heads=4), dict(dim=66, n_heads=4), dict(n_layers=0)], ids=["gqa", "dim", "layers"]
)
def test_config_rejects_inconsistent_shapes(bad):
    base = dict(vocab_size=10, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, hidden_dim=32)
    with pytest.raises(ValueError):
        DecoderConfig(**{**base, **bad})
