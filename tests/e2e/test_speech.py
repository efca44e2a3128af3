"""Voxtral (Whisper encoder, stacked-frame projector, Llama decoder) end to end on a tiny random
checkpoint saved by transformers: loader, encoder features and logits against transformers, one
three-method program (`token_embedding`, `text_decoder`, `audio_encoder`) exported once, greedy
tokens, `genai run --audio` and `--chat` with `/audio`, ExecuTorch's own MultimodalRunner fed the
log-mel chunks, and bad audio (the preprocessing alone: tests/test_audio_processing.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_vision import hf_greedy, tokenizer

from genai_pipeline.audio_files import read_audio
from genai_pipeline.audio_processing import AudioProcessing, audio_clip, expand_audio_prompt
from genai_pipeline.checkpoints.multimodal import load_multimodal
from genai_pipeline.prepare.speech import read_audio_processing
from genai_pipeline.registry import get_spec, infer_spec
from genai_pipeline.registry.voxtral import chat_template

REPO = Path(__file__).resolve().parents[2]
CLIP = REPO / "assets" / "speech" / "fox.wav"  # 3.2 s of espeak-ng speech, 16 kHz (assets/speech/README.md)
SPECIALS = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AUDIO]",
    "[BEGIN_AUDIO]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
]
AUDIO_ID = SPECIALS.index("[AUDIO]")
VOCAB = 320
CHUNK_SECONDS = 2  # the tiny tower's chunk: 200 log-mel frames -> 100 positions -> 25 tokens
TOKENS_PER_CHUNK = 25
MAX_SEQ = 128
NEW_TOKENS = 8
PROMPT = "<audio>What is said?"


@pytest.fixture(scope="session")
def voxtral_checkpoint(tmp_path_factory) -> Path:
    import transformers

    folder = tmp_path_factory.mktemp("voxtral")
    tokenizer(folder / "tokenizer.json", SPECIALS, VOCAB, bos="<s>")  # Voxtral's special tokens first
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (folder / "chat_template.jinja").write_text(chat_template())
    config = transformers.VoxtralConfig(
        audio_config=dict(
            model_type="voxtral_encoder",
            hidden_size=32,
            intermediate_size=128,  # 4 x 32: four frames per token, as in Voxtral-Mini (5120 = 4 x 1280)
            num_hidden_layers=2,
            num_attention_heads=2,
            num_mel_bins=128,
            max_source_positions=100,
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=2,
        ),
        audio_token_id=AUDIO_ID,
    )
    torch.manual_seed(0)
    model = transformers.VoxtralForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.08) if "norm" not in name else p.normal_(1.0, 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    transformers.WhisperFeatureExtractor(feature_size=128, chunk_length=CHUNK_SECONDS).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def voxtral_reference(voxtral_checkpoint):
    import transformers

    return transformers.VoxtralForConditionalGeneration.from_pretrained(voxtral_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def voxtral_ours(voxtral_checkpoint):
    spec = infer_spec(json.loads((voxtral_checkpoint / "config.json").read_text()))
    processing, audio = read_audio_processing(spec, voxtral_checkpoint)
    return load_multimodal(spec, voxtral_checkpoint, MAX_SEQ, audio), processing


@pytest.fixture(scope="session")
def voxtral_program(voxtral_checkpoint, tmp_path_factory) -> Path:
    """The one export of the session: one program, three methods."""
    import genai_pipeline
    from genai_pipeline.options import PrepareOptions

    out = tmp_path_factory.mktemp("voxtral-program") / "out"
    return genai_pipeline.export(
        out=out, prepare=PrepareOptions(max_seq_len=MAX_SEQ, checkpoint=voxtral_checkpoint)
    ).folder


def input_features(processing: AudioProcessing) -> torch.Tensor:
    """The clip's log-mel chunks, [chunks, 128, frames], as transformers' Voxtral model takes them."""
    return torch.from_numpy(np.stack(audio_clip(read_audio(CLIP, 16000), processing).chunks))


def prompt_ids(checkpoint: Path, processing: AudioProcessing) -> list[int]:
    from tokenizers import Tokenizer

    clip = audio_clip(read_audio(CLIP, 16000), processing)
    text = expand_audio_prompt(PROMPT, [clip], processing)
    return Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(text).ids


def test_voxtral_entry_and_checkpoint_settings(voxtral_ours):
    spec = get_spec("voxtral-mini-3b")
    assert (spec.audio.config.frames, spec.audio.config.tokens_per_chunk, spec.audio.config.stack) == (3000, 375, 4)
    model, processing = voxtral_ours
    assert (processing.chunk_length, processing.chunk_frames, processing.tokens_per_chunk) == (2, 200, TOKENS_PER_CHUNK)
    assert model.audio.config.frames == 200 and model.decoder.config.head_dim == 16


def test_a_feature_extractor_that_does_not_fit_the_tower_is_refused(voxtral_checkpoint, tmp_path):
    import shutil

    import transformers

    from genai_pipeline.errors import CheckpointError

    folder = Path(shutil.copytree(voxtral_checkpoint, tmp_path / "copy"))
    transformers.WhisperFeatureExtractor(feature_size=128).save_pretrained(folder)  # 30-s chunks: 3000 frames
    with pytest.raises(CheckpointError, match="128 mel bins x 3000 frames .* but the audio tower takes 128 x 200"):
        read_audio_processing(get_spec("voxtral-mini-3b"), folder)


def test_audio_features_and_logits_match_transformers(voxtral_ours, voxtral_reference, voxtral_checkpoint):
    model, processing = voxtral_ours
    features = input_features(processing)
    assert features.shape == (2, 128, 200)  # 3.2 s -> two 2-s chunks
    with torch.no_grad():
        expected = voxtral_reference.model.get_audio_features(features).pooler_output
        got = torch.cat([model.audio(chunk.unsqueeze(0))[0] for chunk in features])
    assert got.shape == expected.shape == (2 * TOKENS_PER_CHUNK, 64)
    assert expected.abs().max() > 0.1 and (got - expected).abs().max() <= 1e-4

    ids = prompt_ids(voxtral_checkpoint, processing)
    assert ids.count(AUDIO_ID) == 2 * TOKENS_PER_CHUNK and ids[:2] == [1, SPECIALS.index("[BEGIN_AUDIO]")]
    with torch.no_grad():
        expected = voxtral_reference(input_ids=torch.tensor([ids]), input_features=features).logits[0, -1]
        h = model.decoder.embed(torch.tensor([ids]))
        h[0, [i for i, t in enumerate(ids) if t == AUDIO_ID]] = got
        logits = model.decoder.forward_embeddings(h, torch.tensor([0]))[0, -1]
    assert expected.abs().max() > 0.5 and (logits - expected).abs().max() <= 1e-4


def run_json(capture, *argv: str) -> dict:
    from genai_pipeline.cli import main

    capture.readouterr()
    assert main(["run", *argv, "--json"]) == 0
    return json.loads(capture.readouterr().out)


def test_program_matches_transformers_and_executorch_multimodal_runner(
    voxtral_program, voxtral_ours, voxtral_reference, voxtral_checkpoint, capfd
):
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    from executorch.extension.llm.runner import GenerationConfig, MultimodalRunner, make_audio_input, make_token_input
    from executorch.runtime import Runtime

    model, processing = voxtral_ours
    manifest = json.loads((voxtral_program / "manifest.json").read_text())
    assert manifest["artifacts"]["multimodal"]["methods"] == ["token_embedding", "text_decoder", "audio_encoder"]
    assert manifest["audio"]["audio_token_id"] == AUDIO_ID and manifest["audio"]["tokens_per_chunk"] == TOKENS_PER_CHUNK

    features = input_features(processing)
    program = Runtime.get().load_program(str(voxtral_program / "multimodal.pte"))
    encoder = program.load_method("audio_encoder")
    got = torch.cat([encoder.execute([chunk.unsqueeze(0).contiguous()])[0].clone()[0] for chunk in features])
    with torch.no_grad():
        expected = voxtral_reference.model.get_audio_features(features).pooler_output
    assert (got - expected).abs().max() <= 1e-3

    ours = run_json(
        capfd, str(voxtral_program), "--audio", str(CLIP), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)
    )
    ids = ours["prompt_tokens"]
    assert ids == prompt_ids(voxtral_checkpoint, processing) and ours["audio_tokens"] == 2 * TOKENS_PER_CHUNK
    greedy = hf_greedy(voxtral_reference, ids, features, NEW_TOKENS, eos=2, media="input_features")
    assert len(greedy) >= 3 and ours["tokens"] == greedy

    # ExecuTorch's stock runner: text inputs through token_embedding, each 30-s chunk (here 2 s) as
    # one preprocessed audio input (float32 [1, n_mels, frames]) through audio_encoder.
    first, last = ids.index(AUDIO_ID), len(ids) - ids[::-1].index(AUDIO_ID)
    inputs = [make_token_input(ids[:first])]
    inputs += [make_audio_input(chunk.unsqueeze(0).contiguous()) for chunk in features]
    inputs += [make_token_input(ids[last:])]
    capfd.readouterr()
    stats = []
    MultimodalRunner(str(voxtral_program / "multimodal.pte"), str(voxtral_program / "tokenizer.json")).generate(
        inputs, GenerationConfig(echo=False, max_new_tokens=len(greedy), temperature=0.0), stats_callback=stats.append
    )
    printed = capfd.readouterr().out
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(voxtral_program / "tokenizer.json")).decode(greedy, skip_special_tokens=False)
    assert stats[0].num_prompt_tokens == len(ids)
    assert text.strip() and text in printed


def test_program_stores_each_weight_once_and_says_which_runner_runs_it(voxtral_program, voxtral_ours):
    from genai_pipeline.inspect import inspect_program

    model, _ = voxtral_ours
    tensors = {t.data_ptr(): t for t in model.parameters()}
    tensors.update({b.data_ptr(): b for name, b in model.named_buffers() if "kv_cache" not in name})
    expected = sum(t.numel() * t.element_size() for t in tensors.values())
    report = inspect_program(voxtral_program / "multimodal.pte")
    stored = (
        report["weights"]["bytes"]
        if "weights" in report
        else report["constant_segment"]["bytes"] + report["named_data"]["bytes"]
    )
    assert expected <= stored <= 1.02 * expected, (stored, expected)
    assert report["stock_runners"] == {"TextLLMRunner": "no `forward` or `prefill` method", "MultimodalRunner": None}


def test_chat_takes_audio_with_a_command(voxtral_program, voxtral_reference, monkeypatch, capsys):
    """`genai run --chat` with `/audio PATH` (a bad path first: one line, the chat goes on): the
    checkpoint's chat template, the clip expanded where it marks the audio part; both replies
    transformers' greedy ones on the whole conversation (the second from the kept cache)."""
    import io

    from tokenizers import Tokenizer

    from genai_pipeline.cli import main

    stdin = f"/audio {CLIP.parent / 'missing.wav'}\n/audio {CLIP}\nWhat is said?\nAnd then?\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    capsys.readouterr()
    assert main(["run", str(voxtral_program), "--chat", "--max-new-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert "missing.wav' not found" in err

    processing = AudioProcessing(tokens_per_chunk=TOKENS_PER_CHUNK, chunk_length=CHUNK_SECONDS)
    tok = Tokenizer.from_file(str(voxtral_program / "tokenizer.json"))
    clip = audio_clip(read_audio(CLIP, 16000), processing)
    features = torch.from_numpy(np.stack(clip.chunks))
    rendered, replies = "<s>[INST]<audio>What is said?[/INST]", []
    for turn in range(2):
        if turn:
            rendered += f"{replies[-1]}</s>[INST]And then?[/INST]"
        ids = tok.encode(expand_audio_prompt(rendered, [clip], processing), add_special_tokens=False).ids
        tokens = hf_greedy(voxtral_reference, ids, features, 4, eos=2, media="input_features")
        assert tokens
        replies.append(tok.decode(tokens))
    assert out == "".join(f"{r}\n" for r in replies)


def _run_error(capsys, *argv: str) -> str:
    from genai_pipeline.cli import main

    capsys.readouterr()
    assert main(["run", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ")
    return err[-1]


def test_bad_audio_is_one_line(voxtral_program, tmp_path, capsys):
    corrupt = tmp_path / "corrupt.wav"
    corrupt.write_bytes(b"RIFF\x00\x00\x00\x00WAVEfmt garbage")
    mp3ish = tmp_path / "song.ogg"
    import soundfile

    soundfile.write(str(mp3ish), np.zeros(1600, dtype=np.float32), 16000, format="OGG")
    empty = tmp_path / "empty.wav"
    soundfile.write(str(empty), np.zeros(0, dtype=np.float32), 16000)
    folder = str(voxtral_program)
    assert "not found" in _run_error(capsys, folder, "--audio", str(tmp_path / "none.wav"), "--prompt", "x")
    assert "cannot read" in _run_error(capsys, folder, "--audio", str(corrupt), "--prompt", "x")
    assert "WAV or FLAC" in _run_error(capsys, folder, "--audio", str(mp3ish), "--prompt", "x")
    assert "no audio samples" in _run_error(capsys, folder, "--audio", str(empty), "--prompt", "x")
    two = _run_error(capsys, folder, "--audio", str(CLIP), "--prompt", "<audio> and <audio>")
    assert "2 <audio> placeholder(s) but 1 audio file(s)" in two
    assert "cannot take --image" in _run_error(capsys, folder, "--image", str(CLIP), "--prompt", "x")
    long = tmp_path / "long.flac"
    soundfile.write(str(long), np.zeros(16000 * 20, dtype=np.float32), 16000, format="FLAC")
    assert "context is 128" in _run_error(capsys, folder, "--audio", str(long), "--prompt", "x")


def test_commands_not_built_for_speech_say_so(voxtral_program, capsys):
    from genai_pipeline.cli import main

    for argv in (["eval", str(voxtral_program), "--text", str(CLIP)], ["bench", str(voxtral_program)]):
        capsys.readouterr()
        assert main(argv) == 2
        assert "holds a speech model: genai" in capsys.readouterr().err.strip().splitlines()[-1]


def test_serve_refuses_and_a_malformed_audio_section_is_told(voxtral_program, tmp_path):
    from genai_pipeline.errors import InputError, ProgramError
    from genai_pipeline.manifest import Manifest
    from genai_pipeline.serve.engine import Engine

    with pytest.raises(InputError, match="holds a speech model: genai serve"):
        Engine(voxtral_program)
    data = json.loads((voxtral_program / "manifest.json").read_text())
    assert Manifest.read(voxtral_program).audio == data["audio"]
    data["audio"]["config"]["n_mels"] = 0
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ProgramError, match="audio config"):
        Manifest.read(tmp_path)


def test_export_refuses_quantized_recipes_and_split(voxtral_checkpoint, tmp_path):
    import genai_pipeline
    from genai_pipeline.errors import InputError
    from genai_pipeline.options import PrepareOptions, QuantOptions

    prepare = PrepareOptions(max_seq_len=MAX_SEQ, checkpoint=voxtral_checkpoint)
    with pytest.raises(InputError, match="fp32 only"):
        genai_pipeline.export(out=tmp_path / "q", prepare=prepare, quant=QuantOptions(recipe="8da4w"))
    with pytest.raises(InputError, match="drop --split"):
        genai_pipeline.export(
            out=tmp_path / "s", prepare=PrepareOptions(max_seq_len=MAX_SEQ, checkpoint=voxtral_checkpoint, split=True)
        )
