"""Every family: our eager decoder against transformers (1e-4), the exported hybrid program against
our eager decoder (1e-3), its greedy tokens against transformers', and the program in ExecuTorch's
own TextLLMRunner. One tiny checkpoint per family (2 layers, width 64, vocab 384), built and saved by
transformers, with a byte-level BPE of that vocabulary (ASCII tokens only); each family's program is
lowered once per module."""

import json
import shutil

import pytest
import torch
from conftest import TINY_VOCAB, text_llm_runner
from safetensors.torch import load_file, save_file
from tiny_hf import EAGER_ONLY, FAMILIES, MAX_SEQ, max_diff_to_transformers, save_tiny, train_ascii_tokenizer

import genai_pipeline
from genai_pipeline.checkpoints.hf import load_decoder
from genai_pipeline.errors import CheckpointError
from genai_pipeline.inspect import inspect_program
from genai_pipeline.manifest import Manifest
from genai_pipeline.options import PrepareOptions
from genai_pipeline.registry import get_spec
from genai_pipeline.runtime.generate import generate, greedy_token
from genai_pipeline.runtime.open import open_session
from genai_pipeline.runtime.session import DecoderSession, EagerSession
from genai_pipeline.tokenizer import Tokenizer

PREFILL_LEN = 8
# 19 tokens: two full prefill chunks and a padded one, then decode; all well past the windows of 8.
PROMPT = torch.randint(1, TINY_VOCAB, (19,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_eager_matches_transformers(tmp_path, model_type):
    save_tiny(tmp_path, model_type)
    assert max_diff_to_transformers(tmp_path, FAMILIES[model_type].spec) <= 1e-4


VARIANTS = {
    # LongRoPE's long factors: the 24 tokens and the cache of 64 both exceed the original 16.
    "phi3-long-factors": ("phi3", dict(original_max_position_embeddings=16)),
    # Phi-3-mini-4k style: no RoPE scaling, no window, untied head.
    "phi3-plain": ("phi3", dict(rope_scaling=None, sliding_window=None, tie_word_embeddings=False)),
    "gemma3-softcap": ("gemma3_text", dict(final_logit_softcapping=3.0)),
    "ministral-alternating-window": ("ministral", {}),
    "granite-untied-head": ("granite", dict(tie_word_embeddings=False)),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_match_transformers(tmp_path, variant):
    model_type, config = VARIANTS[variant]
    save_tiny(tmp_path, model_type, **config)
    family = FAMILIES.get(model_type) or EAGER_ONLY[model_type]
    assert max_diff_to_transformers(tmp_path, family.spec) <= 1e-4


def _to_hub_layout(folder, drop: tuple[str, ...], add: dict) -> None:
    """Rewrite config.json the way the Hub's (transformers 4.x) files spell it."""
    path = folder / "config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in drop}
    path.write_text(json.dumps({**config, **add}))


def test_hub_layout_configs_read_like_transformers(tmp_path):
    """4.x spellings: Gemma's rope_local_base_freq + sliding_window_pattern, Phi's rope_scaling."""
    gemma, phi = tmp_path / "gemma", tmp_path / "phi"
    save_tiny(gemma, "gemma3_text")
    _to_hub_layout(
        gemma,
        ("rope_parameters", "layer_types", "_sliding_window_pattern"),
        dict(rope_theta=10000.0, rope_local_base_freq=100.0, sliding_window_pattern=2),
    )
    save_tiny(phi, "phi3")
    rope = json.loads((phi / "config.json").read_text())["rope_parameters"]
    _to_hub_layout(
        phi,
        ("rope_parameters",),
        dict(
            rope_theta=10000.0,
            rope_scaling={"type": "longrope", "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]},
        ),
    )
    for folder, model_type in ((gemma, "gemma3_text"), (phi, "phi3")):
        assert max_diff_to_transformers(folder, FAMILIES[model_type].spec) <= 1e-4, model_type


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    return train_ascii_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")


@pytest.fixture(scope="module", params=list(FAMILIES))
def exported(request, tmp_path_factory, tokenizer_json):
    """(spec, checkpoint, program folder) of one family's hybrid xnnpack program, its entry inferred
    from the checkpoint as `genai export --checkpoint DIR` infers it."""
    model_type = request.param
    spec = get_spec(FAMILIES[model_type].spec)
    folder = save_tiny(tmp_path_factory.mktemp(f"{model_type}_checkpoint"), model_type)
    shutil.copy(tokenizer_json, folder / "tokenizer.json")
    out = tmp_path_factory.mktemp(f"{model_type}_hybrid")
    options = PrepareOptions(mode="hybrid", max_seq_len=MAX_SEQ, prefill_len=PREFILL_LEN, checkpoint=folder)
    genai_pipeline.export(out=out, prepare=options)
    return spec, folder, out


def test_the_checkpoint_names_its_family(exported):
    spec, _, out = exported
    manifest = Manifest.read(out)
    assert manifest.family == spec.family
    assert manifest.model == f"{spec.family} (custom: 2 layers, dim 64)"  # the family, never another entry


def test_hybrid_program_matches_eager(exported):
    spec, folder, out = exported
    program, eager = DecoderSession(out), EagerSession(load_decoder(spec, folder, MAX_SEQ))
    got, want = program.prefill(PROMPT), eager.prefill(PROMPT)
    assert want.abs().max() > 0.5
    assert (got - want).abs().max().item() <= 1e-3
    for token in PROMPT[:8]:  # 8 decode steps
        got, want = program.step(token), eager.step(token)
        assert (got - want).abs().max().item() <= 1e-3


def test_greedy_tokens_of_the_program_are_transformers(exported):
    import transformers

    spec, folder, out = exported
    ours = generate(DecoderSession(out), PROMPT, 12, greedy_token).tokens
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = list(PROMPT)
    with torch.no_grad():  # greedy without generate(), which would stop at the checkpoint's EOS
        for _ in range(12):
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ours == ids[len(PROMPT) :]


def test_program_runs_in_executorchs_text_llm_runner(exported):
    """ExecuTorch's own runner (its C++ tokenizer, prefiller and sampler) gives our greedy text."""
    _, _, out = exported
    prompt = "The list object"
    session, tokenizer = open_session(out), Tokenizer.from_folder(out)
    ours = generate(session, tokenizer.encode(prompt), 16, greedy_token, session.manifest.eos_ids)
    text, generated, prompt_tokens = text_llm_runner(out, prompt, 16, bos=True)
    assert prompt_tokens == len(ours.prompt_tokens)  # the same prompt ids, BOS included
    eos = ours.stop_reason == "eos"  # the runner hands the end token on too
    assert generated == len(ours.tokens) + eos
    assert text.startswith(tokenizer.decode(ours.tokens)) if eos else text == tokenizer.decode(ours.tokens)


def test_hybrid_program_has_what_executorchs_text_llm_runner_calls(exported):
    """Its methods, their inputs and the metadata the runner reads, as `genai inspect` checks them
    (tests/runtime/test_llm_runner.py and test_smollm2.py run such programs in the runner)."""
    _, _, out = exported
    assert inspect_program(out / "text_decoder.pte")["stock_runners"]["TextLLMRunner"] is None


def test_fused_phi3_tensors_are_split_in_order(tmp_path):
    save_tiny(tmp_path, "phi3")
    tensors = load_file(tmp_path / "model.safetensors")
    model = load_decoder(get_spec("phi_4_mini"), tmp_path, MAX_SEQ)
    attention, mlp = model.layers[1].attention, model.layers[1].feed_forward
    wq, wk, wv = tensors["model.layers.1.self_attn.qkv_proj.weight"].split([64, 32, 32])
    w1, w3 = tensors["model.layers.1.mlp.gate_up_proj.weight"].chunk(2)
    for ours, theirs in ((attention.wq, wq), (attention.wk, wk), (attention.wv, wv), (mlp.w1, w1), (mlp.w3, w3)):
        torch.testing.assert_close(ours.weight, theirs, rtol=0, atol=0)


def test_fused_tensor_of_the_wrong_shape_is_named(tmp_path):
    save_tiny(tmp_path, "phi3")
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(100, 64)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_decoder(get_spec("phi_4_mini"), tmp_path, MAX_SEQ)
    assert "qkv_proj" in str(e.value) and "(100, 64)" in str(e.value) and "(128, 64)" in str(e.value)
