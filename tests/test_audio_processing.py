"""Audio preprocessing against its oracles: log-mel features of real speech (assets/speech/fox.wav)
against transformers' WhisperFeatureExtractor, the resampler against the analytic signal, WAV /
FLAC files mixed to mono."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from genai_pipeline.audio_files import read_audio, resample
from genai_pipeline.audio_processing import AudioProcessing, audio_clip, mel_filters

CLIP = Path(__file__).resolve().parents[1] / "assets" / "speech" / "fox.wav"  # espeak-ng, 16 kHz (its README)


def test_log_mel_of_real_speech_equals_whisper_feature_extractor():
    from transformers import WhisperFeatureExtractor

    samples = read_audio(CLIP, 16000)
    processing = AudioProcessing(tokens_per_chunk=375)  # Voxtral's: 128 bins, 30-s chunks
    extractor = WhisperFeatureExtractor(feature_size=128)
    assert np.abs(mel_filters(processing) - extractor.mel_filters).max() <= 1e-12
    expected = extractor(
        samples, sampling_rate=16000, return_tensors="np", padding=True, pad_to_multiple_of=480000, truncation=False
    )["input_features"]
    clip = audio_clip(samples, processing)
    assert expected.shape == (1, 128, 3000) and len(clip.chunks) == 1
    assert np.abs(clip.chunks[0] - expected[0]).max() <= 1e-5
    assert expected[0].max() - expected[0].min() > 1.0  # speech, not silence


def test_resampler_keeps_the_band_and_removes_what_would_alias():
    def tones(t: np.ndarray, top: float) -> np.ndarray:
        return (
            np.sin(2 * np.pi * 440 * t) + 0.5 * np.sin(2 * np.pi * 2500 * t + 0.3) + 0.25 * np.sin(2 * np.pi * top * t)
        )

    for rate, top in ((44100, 7000.0), (48000, 7000.0), (22050, 7000.0), (8000, 3000.0)):
        t = np.arange(rate) / rate
        y = resample(tones(t, top), rate, 16000)
        assert len(y) == 16000
        inner = slice(200, -200)  # the signal is zero outside: the edges ring
        assert np.abs(y - tones(np.arange(16000) / 16000, top))[inner].max() <= 1e-4, rate
    t = np.arange(44100) / 44100
    folded = resample(np.sin(2 * np.pi * 11000 * t), 44100, 16000)  # 11 kHz would fold to 5 kHz
    assert np.abs(folded[200:-200]).max() <= 1e-4


def test_audio_files_are_mixed_to_mono_and_resampled(tmp_path):
    import soundfile

    samples = read_audio(CLIP, 16000)
    soundfile.write(str(tmp_path / "stereo.flac"), np.stack([samples, samples / 2], axis=1), 16000, subtype="PCM_24")
    assert np.abs(read_audio(tmp_path / "stereo.flac", 16000) - 0.75 * samples).max() <= 1e-6

    t = np.arange(44100) / 44100
    tones = 0.5 * np.sin(2 * np.pi * 440 * t) + 0.25 * np.sin(2 * np.pi * 5000 * t)
    soundfile.write(str(tmp_path / "tones.wav"), tones, 44100, subtype="FLOAT")
    got = read_audio(tmp_path / "tones.wav", 16000)
    t = np.arange(16000) / 16000
    assert len(got) == 16000
    assert (
        np.abs(got - (0.5 * np.sin(2 * np.pi * 440 * t) + 0.25 * np.sin(2 * np.pi * 5000 * t)))[200:-200].max() <= 1e-4
    )


def test_prompt_and_chat_expansion():
    import pytest

    from genai_pipeline.audio_processing import AudioClip, expand_audio_prompt, expand_rendered_audio_chat
    from genai_pipeline.errors import InputError

    p = AudioProcessing(tokens_per_chunk=2)
    clip = AudioClip((np.zeros((128, 3000), np.float32),) * 2, 40.0)  # two chunks: 4 audio tokens
    run = "[BEGIN_AUDIO]" + "[AUDIO]" * 4
    assert expand_audio_prompt("Say it.", [clip], p) == run + "Say it."
    assert expand_audio_prompt("A <audio> B", [clip], p) == f"A {run} B"
    with pytest.raises(InputError, match="2 <audio> placeholder"):
        expand_audio_prompt("<audio><audio>", [clip], p)
    # a template marks the part with the placeholder, the audio token, or the start and audio tokens
    for mark in ("<audio>", "[AUDIO]", "[BEGIN_AUDIO][AUDIO]"):
        assert expand_rendered_audio_chat(f"[INST]{mark}Hi[/INST]", [clip], p) == f"[INST]{run}Hi[/INST]"
    with pytest.raises(InputError, match="wrote 0 \\[AUDIO\\] for 1 audio clip"):
        expand_rendered_audio_chat("[INST]Hi[/INST]", [clip], p)
