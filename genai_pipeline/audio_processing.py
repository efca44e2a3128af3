"""Audio preprocessing of the runtime, equal to the Hugging Face processor of the speech family.

Voxtral (`VoxtralProcessor`: transformers' `WhisperFeatureExtractor`, `kind="whisper"`), step by step:
1. The samples at `sampling_rate` (audio_files.py reads and resamples a file), padded with
   `padding_value` to a whole number of `chunk_length`-second chunks (at least one), as the
   processor's `pad_to_multiple_of=480000` does.
2. The power spectrogram: frames of `n_fft` samples every `hop_length`, the signal reflected
   `n_fft / 2` samples at both ends (torch.stft's `center=True`), a periodic Hann window; the last
   frame dropped.
3. Slaney-scale mel filters (`feature_size` of them, 0 to 8 kHz, Slaney area normalisation), as
   transformers' `mel_filter_bank(norm="slaney", mel_scale="slaney")`.
4. log10 (floored at 1e-10), floored again at 8 below the maximum of the whole clip, then
   `(x + 4) / 4`.
5. Cut into chunks of `chunk_length * sampling_rate / hop_length` frames: one encoder call each.
The prompt gets, per clip, `[BEGIN_AUDIO]` then N `[AUDIO]` per chunk (mistral_common's Voxtral
encoding), where the user's prompt has `<audio>` (or before the prompt when it has none).

Steps 2-4 run in float32 through torch's STFT, as transformers' default path does.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from genai_pipeline.errors import InputError
from genai_pipeline.media_placeholders import expand_placeholders

KINDS = ("whisper",)


@dataclass(frozen=True)
class AudioProcessing:
    """What a family's Hugging Face processor does to audio and its prompt: the registry entry's
    defaults, overridden by a checkpoint's processor files (checkpoints/processor.py); carried into
    the manifest."""

    tokens_per_chunk: int  # N: audio tokens per chunk (the encoder's output rows)
    kind: str = "whisper"
    sampling_rate: int = 16000
    feature_size: int = 128  # mel bins
    n_fft: int = 400
    hop_length: int = 160
    chunk_length: int = 30  # seconds per encoder call; audio is padded to a multiple
    padding_value: float = 0.0
    placeholder: str = "<audio>"  # what marks audio's place in a user's prompt
    audio_token: str = "[AUDIO]"  # the token whose positions take the audio's embeddings
    audio_start: str = "[BEGIN_AUDIO]"  # before each clip's tokens

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"AudioProcessing.kind must be one of {', '.join(KINDS)}, got '{self.kind}'")
        for name in ("tokens_per_chunk", "sampling_rate", "feature_size", "n_fft", "hop_length", "chunk_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AudioProcessing.{name} must be positive, got {getattr(self, name)}")
        if self.chunk_samples % self.hop_length:
            raise ValueError(
                f"a chunk of {self.chunk_samples} samples is no whole number of {self.hop_length}-sample hops"
            )

    @property
    def chunk_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def chunk_frames(self) -> int:
        return self.chunk_samples // self.hop_length

    @classmethod
    def from_dict(cls, data: dict) -> AudioProcessing:
        if not isinstance(data, dict):
            raise TypeError(f"audio preprocessing is a {type(data).__name__}, not a mapping")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class AudioClip:
    """One clip's encoder inputs: float32 log-mel [feature_size, chunk_frames] per chunk, in order."""

    chunks: tuple[np.ndarray, ...]
    seconds: float  # the clip's length before padding


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    mel = 3.0 * hz / 200.0
    log_part = hz >= 1000.0
    return np.where(log_part, 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) * (27.0 / np.log(6.4)), mel)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel - 15.0)), 200.0 * mel / 3.0)


def mel_filters(p: AudioProcessing) -> np.ndarray:
    """[n_fft / 2 + 1, feature_size]: triangular filters between mel-spaced edges, area-normalised."""
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(8000.0), p.feature_size + 2))
    bins = np.linspace(0, p.sampling_rate // 2, p.n_fft // 2 + 1)
    slopes = edges[None, :] - bins[:, None]
    widths = np.diff(edges)
    down, up = -slopes[:, :-2] / widths[:-1], slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (edges[2:] - edges[:-2]))[None, :]


def log_mel(samples: np.ndarray, p: AudioProcessing) -> np.ndarray:
    """float32 [feature_size, frames] of 1-D samples already padded to whole chunks (steps 2-4), in
    float32 with torch's STFT as transformers computes it where torch is installed (its numpy path
    rounds otherwise: 2.6e-5 apart on assets/speech/fox.wav, in the quietest bins)."""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
    stft = torch.stft(x, p.n_fft, p.hop_length, window=torch.hann_window(p.n_fft), return_complex=True)
    power = stft[..., :-1].abs() ** 2  # [bins, frames]
    mel = torch.from_numpy(mel_filters(p)).to(torch.float32).T @ power
    log = torch.clamp(mel, min=1e-10).log10()
    log = torch.maximum(log, log.max() - 8.0)
    return ((log + 4.0) / 4.0).numpy()


def audio_clip(samples: np.ndarray, p: AudioProcessing) -> AudioClip:
    """Mono samples at `p.sampling_rate` as the encoder's chunks (steps 1-5)."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim != 1 or len(samples) == 0:
        raise InputError("audio must be a non-empty run of mono samples")
    n = -(-len(samples) // p.chunk_samples)
    padded = np.full(n * p.chunk_samples, p.padding_value, dtype=np.float32)
    padded[: len(samples)] = samples
    features = log_mel(padded, p)
    chunks = features.reshape(p.feature_size, n, p.chunk_frames).transpose(1, 0, 2)
    return AudioClip(tuple(np.ascontiguousarray(c) for c in chunks), len(samples) / p.sampling_rate)


def audio_prompt(clip: AudioClip, p: AudioProcessing) -> str:
    """The text standing for one clip: its start token and N audio tokens per chunk."""
    return p.audio_start + p.audio_token * (p.tokens_per_chunk * len(clip.chunks))


def expand_audio_prompt(prompt: str, clips: list[AudioClip], p: AudioProcessing) -> str:
    """Each `<audio>` of the prompt replaced by the next clip's text; with none in the prompt, the
    clips go first. More or fewer placeholders than clips is an error."""
    return expand_placeholders(
        prompt, [audio_prompt(c, p) for c in clips], p.placeholder, "audio file(s)", "--audio", "the audio"
    )


def expand_rendered_audio_chat(text: str, clips: list[AudioClip], p: AudioProcessing) -> str:
    """A rendered chat's audio marks replaced, in order, by the clips' text. The chat template marks
    an audio part with the placeholder or with the audio token itself; the count must be the
    conversation's clips."""
    mark = p.placeholder if p.placeholder in text or not clips else p.audio_token
    if mark == p.audio_token and p.audio_start + mark in text:
        mark = p.audio_start + mark  # a template that writes the start token too: expanded once
    found = text.count(mark)
    if found != len(clips):
        raise InputError(
            f"the chat template wrote {found} {mark} for {len(clips)} audio clip(s) of the conversation: "
            "it does not place audio parts where this model's processor expects them"
        )
    pieces = text.split(mark)
    return pieces[0] + "".join(audio_prompt(c, p) + rest for c, rest in zip(clips, pieces[1:]))
