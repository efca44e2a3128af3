"""`genai export --split`: one program per component (vision_encoder.pte, token_embedding.pte,
text_decoder.pte), against the one-program layout of the same tiny SmolVLM checkpoint
(tests/e2e/test_vision.py): files, manifest, what each program stores, `genai inspect DIR`, and
`genai run --image` giving the one-program layout's greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_vision import IMAGE, MAX_SEQ, NEW_TOKENS, PROMPT, SPECIALS, checkpoint, image_file, infer_spec, once, program  # noqa: F401  session fixtures (built once: test_vision.once)

from genai_pipeline.cli import main
from genai_pipeline.options import SamplingOptions
from genai_pipeline.runtime.generate import Sampler, generate
from genai_pipeline.runtime.multimodal import MultimodalSession
from genai_pipeline.tokenizer import Tokenizer

COMPONENTS = ("vision_encoder", "token_embedding", "text_decoder")
DECODER_METHODS = {"dynamic": ["forward"], "hybrid": ["prefill_chunk", "decode_token"]}


@pytest.fixture(scope="session")
def split_program(checkpoint, tmp_path_factory):
    """split_program(mode) -> folder: the --split layout, each mode exported once per session.
    Prefill chunks of 8 tokens: a prompt with an image (about 20 tokens) ends in a partial chunk."""
    import genai_pipeline
    from genai_pipeline.options import PrepareOptions

    def build(mode: str) -> Path:
        def export() -> Path:
            options = PrepareOptions(max_seq_len=MAX_SEQ, checkpoint=checkpoint, split=True, mode=mode, prefill_len=8)
            return genai_pipeline.export(out=tmp_path_factory.mktemp(f"smolvlm-split-{mode}"), prepare=options).folder

        return once(f"split {mode}", export)

    return build


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


@pytest.mark.parametrize("mode", ["dynamic", "hybrid"])
def test_split_export_writes_one_program_per_component(split_program, mode, capsys):
    folder = split_program(mode)
    manifest = _manifest(folder)
    assert sorted(p.name for p in folder.glob("*.pte")) == sorted(f"{c}.pte" for c in COMPONENTS)
    assert {k: a["file"] for k, a in manifest["artifacts"].items()} == {c: f"{c}.pte" for c in COMPONENTS}
    vision = manifest["vision"]
    assert vision["layout"] == "split" and manifest["mode"] == mode
    methods = {c: vision["components"][c]["methods"] for c in COMPONENTS}
    assert methods == {
        "vision_encoder": ["forward"],
        "token_embedding": ["forward"],
        "text_decoder": DECODER_METHODS[mode],
    }
    assert all(vision["components"][c]["file"] == f"{c}.pte" for c in COMPONENTS)
    assert (vision["image_size"], vision["tokens_per_image"], vision["image_token_id"]) == (
        IMAGE,
        4,
        SPECIALS.index("<image>"),
    )
    assert vision["special_token_ids"] == {
        t: SPECIALS.index(t) for t in ("<image>", "<fake_token_around_image>", "<global-img>")
    }
    assert vision["preprocessing"]["image_mean"] == [0.5, 0.5, 0.5] and vision["preprocessing"]["tile_size"] == IMAGE

    # genai inspect DIR: each program, with its methods and their inputs
    assert main(["inspect", str(folder), "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert list(reports) == [f"{c}.pte" for c in COMPONENTS]
    assert {name: sorted(r["methods"]) for name, r in reports.items()} == {
        f"{c}.pte": sorted(methods[c]) for c in COMPONENTS
    }
    pixels = reports["vision_encoder.pte"]["methods"]["forward"]["inputs"][0]
    assert (pixels["dtype"], pixels["shape"]) == ("byte", [1, 3, IMAGE, IMAGE])  # a device feeds raw uint8 pixels
    decoder_first_input = reports["text_decoder.pte"]["methods"][DECODER_METHODS[mode][0]]["inputs"][0]
    assert decoder_first_input["dtype"] == "float"  # embeddings in, not ids
    if mode == "hybrid":
        assert reports["text_decoder.pte"]["metadata"]["get_prefill_len"] == 8
        assert all(b["shared"] for b in reports["text_decoder.pte"]["mutable_buffers"].values())  # one KV cache


def test_each_split_program_stores_its_components_weights_once(split_program, checkpoint):
    """vision_encoder.pte holds the tower + connector, token_embedding.pte the table, text_decoder.pte
    the decoder with its head (the tied table once more: separate files cannot share it), each
    within 2 % of its tensors' bytes; prefill and decode share one copy."""
    from genai_pipeline.checkpoints.multimodal import load_multimodal
    from genai_pipeline.inspect import inspect_program
    from genai_pipeline.prepare.multimodal import read_processing

    spec = infer_spec(json.loads((checkpoint / "config.json").read_text()))
    model = load_multimodal(spec, checkpoint, MAX_SEQ, read_processing(spec, checkpoint)[1])

    def nbytes(module, skip=()) -> int:
        tensors = {
            t.data_ptr(): t
            for name, t in [*module.named_parameters(), *module.named_buffers()]
            if "kv_cache" not in name and not name.startswith(skip)
        }
        return sum(t.numel() * t.element_size() for t in tensors.values())

    table = model.decoder.tok_embeddings.weight
    expected = {
        "vision_encoder": nbytes(model.vision),
        "token_embedding": table.numel() * table.element_size(),
        "text_decoder": nbytes(model.decoder, skip=("tok_embeddings",)),  # the tied head reads its own parameter
    }
    assert model.decoder.config.tie_embeddings
    for component, want in expected.items():  # graphs wrapping the whole model stored the RoPE tables in all three
        stored = inspect_program(split_program("hybrid") / f"{component}.pte")["weights"]["bytes"]
        assert want <= stored <= 1.02 * want, (component, stored, want)


def _greedy(folder: Path, image: Path) -> tuple[list[int], torch.Tensor, list[str], int]:
    """Greedy tokens, the logits the reply starts from, the methods its prefill called (in
    order), and the prompt's length."""
    session = MultimodalSession(folder, verify=True)
    ids = session.encode_prompt(Tokenizer.from_folder(folder), PROMPT, [image])
    calls, execute = [], session._execute

    def execute_and_count(graph, inputs):
        calls.append(graph.value)
        return execute(graph, inputs)

    session._execute = execute_and_count
    first = session.prefill(ids)
    assert session.vision_calls == 1
    prefill_calls = list(calls)
    session.reset()
    session.encode_prompt(Tokenizer.from_folder(folder), PROMPT, [image])  # stages the frame again
    result = generate(session, ids, NEW_TOKENS, Sampler(SamplingOptions(temperature=0.0)), (2,))
    return result.tokens, first, prefill_calls, len(ids)


@pytest.mark.parametrize("mode", ["dynamic", "hybrid"])
def test_split_layout_generates_the_one_program_layouts_greedy_tokens(split_program, program, image_file, mode, capsys):
    expected, expected_logits, _, n = _greedy(program, image_file)
    tokens, logits, calls, _ = _greedy(split_program(mode), image_file)
    assert len(expected) > 3 and tokens == expected
    assert (logits - expected_logits).abs().max() <= 1e-4
    # hybrid: whole prefill chunks of 8, a padded partial one, its last row again through decode_token
    decoder = {"dynamic": ["forward"], "hybrid": ["prefill_chunk"] * (n // 8 + 1) + ["decode_token"]}[mode]
    assert n % 8 and calls == ["token_embedding", "vision_encoder", *decoder]

    # and through the CLI, with the --json figures of a vision-language run
    argv = [
        "run",
        str(split_program(mode)),
        "--image",
        str(image_file),
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        str(NEW_TOKENS),
        "--temperature",
        "0",
        "--json",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == expected and out["image_tokens"] == 4 and out["vision_encoder_ms"] > 0


def test_split_is_refused_for_text_only_models_and_kv_mode(checkpoint, tmp_path, capsys):
    assert main(["export", "reference", "--split", "--out", str(tmp_path / "text")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1:] == [
        "error: --split applies to vision-language models only; reference is a text-only model "
        "(its export is one program already)"
    ]
    assert (
        main(["export", "--checkpoint", str(checkpoint), "--split", "--mode", "kv", "--out", str(tmp_path / "kv")]) == 2
    )
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --split takes --mode dynamic")
    assert not (tmp_path / "text").exists() and not (tmp_path / "kv").exists()
