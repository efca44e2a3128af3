"""llama2.c checkpoints: our decoder against a reference implementation of llama2.c's forward
(Meta's complex, interleaved RoPE) written here, one clear error per kind of damage, the registry
entries, and `genai export --checkpoint` + `genai run` on a tiny llama2.c folder."""

import io
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import train_sentencepiece

from genai_pipeline.checkpoints import infer_checkpoint_spec, load_decoder
from genai_pipeline.cli import main
from genai_pipeline.errors import CheckpointError
from genai_pipeline.models.decoder import Decoder
from genai_pipeline.registry import get_spec

SPEC = get_spec("stories15m")
VOCAB = 512  # the tiny SentencePiece model's
# As llama2.c's train.py saves them: no hidden_dim (model.py derives 192 from dim 64, multiple_of 32).
ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=32, max_seq_len=64, dropout=0.0)
HIDDEN = 192
MAX_SEQ = 48


def llama2c_state(args: dict = ARGS, tied: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under llama2.c's names; a tied head is the embedding tensor itself, as
    llama2.c's model.py shares one parameter between the two."""
    g = torch.Generator().manual_seed(seed)

    def weight(*shape, mean=0.0, std=0.08):
        return torch.randn(*shape, generator=g) * std + mean

    dim, hd = args["dim"], args["dim"] // args["n_heads"]
    state = {"tok_embeddings.weight": weight(args["vocab_size"], dim)}
    for i in range(args["n_layers"]):
        state |= {
            f"layers.{i}.attention.wq.weight": weight(args["n_heads"] * hd, dim),
            f"layers.{i}.attention.wk.weight": weight(args["n_kv_heads"] * hd, dim),
            f"layers.{i}.attention.wv.weight": weight(args["n_kv_heads"] * hd, dim),
            f"layers.{i}.attention.wo.weight": weight(dim, args["n_heads"] * hd),
            f"layers.{i}.feed_forward.w1.weight": weight(HIDDEN, dim),
            f"layers.{i}.feed_forward.w2.weight": weight(dim, HIDDEN),
            f"layers.{i}.feed_forward.w3.weight": weight(HIDDEN, dim),
            f"layers.{i}.attention_norm.weight": weight(dim, mean=1.0, std=0.1),
            f"layers.{i}.ffn_norm.weight": weight(dim, mean=1.0, std=0.1),
        }
    state["norm.weight"] = weight(dim, mean=1.0, std=0.1)
    state["output.weight"] = state["tok_embeddings.weight"] if tied else weight(args["vocab_size"], dim)
    return state


def save_llama2c(folder, state=None, args=ARGS, name="model.pt", prefix=""):
    """What llama2.c's train.py writes (`prefix`: "_orig_mod." for a torch.compile'd model)."""
    folder.mkdir(parents=True, exist_ok=True)
    state = llama2c_state(args) if state is None else state
    checkpoint = {
        "model": {prefix + k: v for k, v in state.items()},
        "model_args": args,
        "iter_num": 1000,
        "best_val_loss": 1.5,
        "config": {"batch_size": 8, "dim": args["dim"], "dtype": "float32"},
    }
    torch.save(checkpoint, folder / name)
    return folder


def llama2c_reference(state: dict, args: dict, tokens: list[int]) -> torch.Tensor:
    """llama2.c's model.py forward over all positions at once, RoPE on interleaved pairs as complex
    numbers (Meta's precompute_freqs_cis / apply_rotary_emb): logits [T, vocab]."""
    dim, n_heads, n_kv = args["dim"], args["n_heads"], args["n_kv_heads"]
    hd, t = dim // n_heads, len(tokens)
    freqs = 1.0 / (10000.0 ** (torch.arange(0, hd, 2)[: hd // 2].float() / hd))
    freqs_cis = torch.polar(torch.ones(t, hd // 2), torch.outer(torch.arange(t).float(), freqs))

    def rope(x):  # [T, heads, hd]: (x[2i], x[2i+1]) is the complex number rotated by freqs_cis[:, i]
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs_cis[:, None, :]).flatten(-2)

    def rmsnorm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    h = state["tok_embeddings.weight"][torch.tensor(tokens)]
    mask = torch.full((t, t), float("-inf")).triu(1)
    for i in range(args["n_layers"]):
        w = {k.split(f"layers.{i}.")[1]: v for k, v in state.items() if k.startswith(f"layers.{i}.")}
        x = rmsnorm(h, w["attention_norm.weight"])
        q = rope((x @ w["attention.wq.weight"].T).view(t, n_heads, hd))
        k = rope((x @ w["attention.wk.weight"].T).view(t, n_kv, hd)).repeat_interleave(n_heads // n_kv, dim=1)
        v = (x @ w["attention.wv.weight"].T).view(t, n_kv, hd).repeat_interleave(n_heads // n_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd) + mask
        attention = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, dim)
        h = h + attention @ w["attention.wo.weight"].T
        x = rmsnorm(h, w["ffn_norm.weight"])
        h = (
            h
            + (F.silu(x @ w["feed_forward.w1.weight"].T) * (x @ w["feed_forward.w3.weight"].T))
            @ w["feed_forward.w2.weight"].T
        )
    return rmsnorm(h, state["norm.weight"]) @ state["output.weight"].T


def ours_prefill_then_decode(model: Decoder, tokens: list[int], prefill: int) -> torch.Tensor:
    """Our eager decoder: one prefill chunk, then one token per call (its KV cache carries on)."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        got = [model(ids[:, :prefill], torch.tensor([0]))[0]]
        for i in range(prefill, len(tokens)):
            got.append(model(ids[:, i : i + 1], torch.tensor([i]))[0])
    return torch.cat(got)


TOKENS = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_match_llama2c_reference(tmp_path, tied):
    state = llama2c_state(tied=tied)
    model = load_decoder(SPEC, save_llama2c(tmp_path, state), MAX_SEQ)
    assert model.config.tie_embeddings is tied and model.config.hidden_dim == HIDDEN
    expected = llama2c_reference(state, ARGS, TOKENS)
    assert expected.abs().max() > 0.5, "logits too flat to make the comparison meaningful"
    got = ours_prefill_then_decode(model, TOKENS, prefill=14)
    assert (got - expected).abs().max().item() <= 1e-4


def test_rope_layout_matters(tmp_path, monkeypatch):
    """The oracle can tell: without the wq/wk permutation the logits are far off."""
    import genai_pipeline.checkpoints.llama2c as llama2c

    state = llama2c_state()
    monkeypatch.setattr(llama2c, "_as_ours", lambda name, tensor, config: tensor.to(torch.float32))
    model = load_decoder(SPEC, save_llama2c(tmp_path, state), MAX_SEQ)
    got = ours_prefill_then_decode(model, TOKENS, prefill=14)
    assert (got - llama2c_reference(state, ARGS, TOKENS)).abs().max().item() > 1e-2


def test_compiled_names_and_rope_buffers_are_read(tmp_path):
    state = llama2c_state()
    plain = load_decoder(SPEC, save_llama2c(tmp_path / "plain", state), MAX_SEQ).state_dict()
    extra = {**state, "freqs_cos": torch.zeros(64, 8), "freqs_sin": torch.zeros(64, 8)}
    compiled = load_decoder(SPEC, save_llama2c(tmp_path / "compiled", extra, prefix="_orig_mod."), MAX_SEQ).state_dict()
    assert plain.keys() == compiled.keys()
    for k in plain:
        torch.testing.assert_close(plain[k], compiled[k], rtol=0, atol=0)


def _error(folder) -> str:
    with pytest.raises(CheckpointError) as e:
        load_decoder(SPEC, folder, MAX_SEQ)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_missing_folder_and_files(tmp_path):
    assert "does not exist" in _error(tmp_path / "nope")
    assert "no *.pt file" in _error(tmp_path)
    save_llama2c(tmp_path, name="a.pt")
    save_llama2c(tmp_path, name="b.pt")
    assert "several *.pt files (a.pt, b.pt)" in _error(tmp_path)


def test_truncated_or_foreign_file(tmp_path):
    f = save_llama2c(tmp_path) / "model.pt"
    f.write_bytes(f.read_bytes()[:2000])
    assert "cannot read" in _error(tmp_path) and "model.pt" in _error(tmp_path)
    torch.save({"state_dict": {}}, f)
    assert "not a llama2.c checkpoint" in _error(tmp_path)


def test_model_args_that_do_not_describe_a_model(tmp_path):
    save_llama2c(tmp_path, llama2c_state(), args={k: v for k, v in ARGS.items() if k != "n_heads"})
    assert "model_args" in _error(tmp_path) and "n_heads" in _error(tmp_path)


def test_shape_mismatch_names_the_tensor(tmp_path):
    state = llama2c_state()
    state["layers.1.attention.wk.weight"] = torch.zeros(7, 64)
    message = _error(save_llama2c(tmp_path, state))
    assert "layers.1.attention.wk.weight" in message and "(7, 64)" in message and "(32, 64)" in message


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    state = llama2c_state()
    state["layers.0.feed_forward.w4.weight"] = state.pop("layers.0.feed_forward.w3.weight")
    assert "layers.0.feed_forward.w4.weight" in _error(save_llama2c(tmp_path, state))
    del state["layers.0.feed_forward.w4.weight"]
    assert "layers.0.feed_forward.w3.weight" in _error(save_llama2c(tmp_path, state))


STORIES_ARGS = {  # model_args of the published karpathy/tinyllamas checkpoints
    "stories15m": dict(
        dim=288, n_layers=6, n_heads=6, n_kv_heads=6, vocab_size=32000, multiple_of=32, max_seq_len=256, dropout=0.0
    ),
    "stories110m": dict(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=12, vocab_size=32000, multiple_of=32, max_seq_len=1024, dropout=0.0
    ),
}


@pytest.mark.parametrize("name,params,hidden", [("stories15m", 15e6, 768), ("stories110m", 110e6, 2048)])
def test_registry_entries_read_their_model_args(tmp_path, name, params, hidden):
    spec = get_spec(name)
    assert spec.checkpoint_format == "llama2c" and (spec.bos_id, spec.eos_ids) == (1, (2,))
    assert spec.config.hidden_dim == hidden and spec.config.tie_embeddings
    assert abs(spec.config.num_params / params - 1) < 0.03
    # A checkpoint with these model_args is recognised by its sizes (its tensors are not read).
    save_llama2c(tmp_path, state={}, args=STORIES_ARGS[name])
    inferred, source = infer_checkpoint_spec(tmp_path)
    assert inferred is spec and "model_args" in source and "model.pt" in source


def test_other_sizes_are_the_family_under_a_custom_name(tmp_path):
    spec, _ = infer_checkpoint_spec(save_llama2c(tmp_path))
    assert spec.name == "llama2c (custom: 2 layers, dim 64)" and spec.entry == "stories15m"
    assert (spec.config.n_layers, spec.config.dim) == (2, 64)  # the checkpoint's own config, not the entry's


def test_a_folder_of_neither_format(tmp_path):
    with pytest.raises(CheckpointError, match="neither config.json .* nor a \\*.pt file"):
        infer_checkpoint_spec(tmp_path)


@pytest.fixture(scope="session")
def llama2c_export(tmp_path_factory):
    """A tiny llama2.c folder (.pt + SentencePiece tokenizer.model) exported once by the CLI,
    with no model name: (checkpoint state, export folder, export's stderr)."""
    folder = tmp_path_factory.mktemp("llama2c_checkpoint")
    state = llama2c_state(seed=3)
    save_llama2c(folder, state, name="stories_tiny.pt")
    train_sentencepiece(folder / "tokenizer.model", VOCAB)
    out = tmp_path_factory.mktemp("llama2c_export")
    argv = [
        "export",
        "--checkpoint",
        folder,
        "--target",
        "portable",
        "--mode",
        "hybrid",
        "--max-seq-len",
        MAX_SEQ,
        "--prefill-len",
        8,
        "--out",
        out,
    ]
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:  # capsys is per test; the CLI logs to the sys.stderr of the call
        mp.setattr(sys, "stderr", err)
        assert main([str(a) for a in argv]) == 0, err.getvalue()
    return state, out, err.getvalue()


def test_export_infers_the_entry_and_carries_tokenizer_model(llama2c_export):
    _, out, stderr = llama2c_export
    assert "model: llama2c (custom: 2 layers, dim 64) (inferred from the model_args of" in stderr
    assert (out / "tokenizer.model").is_file() and not (out / "tokenizer.json").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"] == "llama2c (custom: 2 layers, dim 64)" and manifest["entry"] == "stories15m"
    assert manifest["bos_id"] == 1 and manifest["eos_ids"] == [2]
    assert manifest["special_tokens"]["sources"] == {"bos_id": ["registry entry"], "eos_ids": ["registry entry"]}
    assert manifest["config"]["dim"] == 64 and "tokenizer.model" in manifest["files"]


def test_run_generates_what_the_reference_model_generates(llama2c_export, capsys):
    import sentencepiece

    state, out, _ = llama2c_export
    prompt = "Once upon a time, the list"
    assert main(["run", str(out), "--prompt", prompt, "--max-new-tokens", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    tokens = [1, *sp.encode(prompt)]  # BOS prepended
    assert result["prompt_tokens"] == tokens
    expected = []  # greedy decoding with the reference forward, stopping before EOS
    while len(expected) < 8:
        token = int(llama2c_reference(state, ARGS, tokens + expected)[-1].argmax())
        if token == 2:
            break
        expected.append(token)
    assert result["tokens"] == expected and len(expected) > 0
    assert result["text"] == sp.decode(expected) and result["text"].strip()
