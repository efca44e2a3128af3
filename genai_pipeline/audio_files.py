"""Audio files as a speech model hears them: WAV or FLAC decoded by soundfile (libsndfile), its
channels averaged to mono, resampled to the model's rate.

`resample` is a band-limited (windowed-sinc) polyphase resampler: for a rate ratio reduced to
new/orig, each of the `new` output phases is a fixed FIR filter over the input, a sinc whose cutoff
sits just under the lower rate's Nyquist frequency (`ROLLOFF`), shaped by a Kaiser window of
`HALF_WIDTH` zero crossings each side (torchaudio's "kaiser_best" parameters). Content below the
cutoff passes within about 1e-4; content above the new Nyquist frequency is suppressed, not folded
back. The signal is taken as zero outside the file, as transformers' and torchaudio's resamplers do.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from genai_pipeline.errors import InputError

HALF_WIDTH = 64  # zero crossings of the sinc on each side of a tap's centre
ROLLOFF = 0.9475937167399596  # the cutoff, as a fraction of the lower rate's Nyquist frequency
KAISER_BETA = 14.769656459379492
READABLE = ("WAV", "FLAC")
BATCH = 1 << 20  # input samples copied into windows at once (8 MB): memory stays flat for any length


def read_audio(path: Path, sampling_rate: int, max_seconds: float | None = None, why: str = "") -> np.ndarray:
    """float32 mono samples in [-1, 1] at `sampling_rate`; a missing, unreadable, empty or other
    format file is one InputError, and so is one longer than `max_seconds` (`why`: what limits it),
    told before it is decoded."""
    import soundfile

    path = Path(path)
    if not path.is_file():
        raise InputError(f"audio file '{path}' not found")
    try:
        info = soundfile.info(str(path))
        if info.format not in READABLE:
            raise InputError(
                f"'{path}' is {info.format_info or info.format} audio; this pipeline reads WAV or FLAC: convert it"
            )
        if max_seconds is not None and info.frames > max_seconds * info.samplerate:
            raise InputError(f"'{path}' is {info.frames / info.samplerate:.1f} s of audio; {why}")
        samples, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except InputError:
        raise
    except Exception as e:  # libsndfile's errors (soundfile.LibsndfileError, RuntimeError) for a damaged file
        message = " ".join(str(e).split())
        raise InputError(f"cannot read '{path}' as audio ({message}); pass a WAV or FLAC file") from None
    if samples.shape[0] == 0:
        raise InputError(f"'{path}' holds no audio samples")
    mono = samples.mean(axis=1, dtype=np.float64)
    if not np.isfinite(mono).all():
        raise InputError(f"'{path}' holds samples that are not finite numbers")
    return resample(mono, rate, sampling_rate).astype(np.float32)


def resample(x: np.ndarray, orig: int, new: int) -> np.ndarray:
    """1-D `x` sampled at `orig` Hz, resampled to `new` Hz: ceil(len(x) * new / orig) samples (float64)."""
    if orig <= 0 or new <= 0:
        raise InputError(f"sample rates must be positive, got {orig} Hz -> {new} Hz")
    x = np.asarray(x, dtype=np.float64)
    if orig == new:
        return x
    g = math.gcd(orig, new)
    orig, new = orig // g, new // g
    kernel, width = _kernel(orig, new)  # [new, taps]: output phase j of block k reads x[k*orig - width : ...]
    blocks = math.ceil(len(x) / orig)
    padded = np.zeros(width + blocks * orig + width + orig, dtype=np.float64)
    padded[width : width + len(x)] = x
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel.shape[1])[::orig][:blocks]
    step = max(1, BATCH // kernel.shape[1])  # blocks per product: the windows are copied, a batch at a time
    y = np.concatenate([windows[i : i + step] @ kernel.T for i in range(0, blocks, step)]).reshape(-1)
    return y[: math.ceil(len(x) * new / orig)]


def _kernel(orig: int, new: int) -> tuple[np.ndarray, int]:
    """The polyphase filter bank, [new, taps], and the input samples read before each block."""
    cutoff = min(orig, new) * ROLLOFF  # in cycles per `orig` input samples' span, as below
    width = math.ceil(HALF_WIDTH * orig / cutoff)
    taps = np.arange(-width, width + orig, dtype=np.float64)[None, :] / orig  # input times, in blocks
    phases = np.arange(new, dtype=np.float64)[:, None] / new  # output times, in blocks
    t = (taps - phases) * cutoff  # distance in zero crossings of the sinc
    inside = np.abs(t) <= HALF_WIDTH
    window = np.where(inside, np.i0(KAISER_BETA * np.sqrt(np.clip(1 - (t / HALF_WIDTH) ** 2, 0, 1))), 0.0)
    window /= np.i0(KAISER_BETA)
    return np.sinc(t) * window * cutoff / orig, width
