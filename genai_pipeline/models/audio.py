"""The one export-friendly audio encoder: a speech family is this file plus an AudioConfig, as an
image family is models/vision.py plus a VisionConfig.

Read top to bottom: config, encoder layer, connector, encoder.

An `AudioEncoder` takes one chunk of log-mel features, float32 `[1, n_mels, frames]` (the
runtime's `audio_processing.log_mel`, or a device's own, as ExecuTorch's MultimodalRunner feeds
them), and returns the chunk's embeddings in the text decoder's space, `[1, tokens, text_dim]`.
The chunk length is fixed (Whisper's 30 s = 3000 frames); longer audio is several chunks, one
call each.

Voxtral (`VoxtralForConditionalGeneration`) as transformers 5.x builds it: Whisper's encoder (two
GeLU convolutions, the second of stride 2; learned positions; pre-norm layers whose key projection
has no bias; a final LayerNorm), then `stack` consecutive frames concatenated into one token and
projected by a bias-free linear, GeLU, linear (`VoxtralMultiModalProjector`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from genai_pipeline.models import vision


@dataclass(frozen=True)
class AudioConfig:
    n_mels: int
    frames: int  # log-mel frames per chunk, the encoder's fixed input length (Whisper: 3000)
    dim: int
    n_layers: int
    n_heads: int
    hidden_dim: int
    text_dim: int  # width of the text decoder's embeddings
    stack: int = 4  # consecutive encoder frames concatenated into one token (Voxtral's reshape)
    norm_eps: float = 1e-5

    def __post_init__(self):
        for name in ("n_mels", "frames", "dim", "n_layers", "n_heads", "hidden_dim", "text_dim", "stack"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AudioConfig.{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_heads:
            raise ValueError(f"AudioConfig.dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")
        if self.frames % 2 or self.positions % self.stack:
            raise ValueError(
                f"AudioConfig.frames ({self.frames}) must halve into positions that `stack` ({self.stack}) divides"
            )

    @property
    def qkv_bias(self) -> bool:
        return True  # q and v (models.vision.Attention's switch); Attention drops k's

    @property
    def positions(self) -> int:
        return self.frames // 2  # after the stride-2 convolution (Whisper's max_source_positions)

    @property
    def tokens_per_chunk(self) -> int:
        return self.positions // self.stack

    @property
    def num_params(self) -> int:
        d, h = self.dim, self.hidden_dim
        convs = self.n_mels * d * 3 + d + d * d * 3 + d
        layer = 4 * d * d + 3 * d + 2 * d * h + h + d + 4 * d  # k_proj has no bias
        connector = self.stack * d * self.text_dim + self.text_dim * self.text_dim
        return convs + self.positions * d + self.n_layers * layer + 2 * d + connector

    @classmethod
    def from_dict(cls, data: dict) -> AudioConfig:
        return cls(**data)


class Attention(vision.Attention):
    """Whisper's: the image tower's attention (q, v and out projections with bias) with a bias-free key."""

    def __init__(self, config: AudioConfig):
        super().__init__(config)
        self.k_proj = nn.Linear(config.dim, config.dim, bias=False)


class EncoderLayer(nn.Module):
    def __init__(self, config: AudioConfig):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.self_attn = Attention(config)
        self.final_layer_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.fc1 = nn.Linear(config.dim, config.hidden_dim)
        self.fc2 = nn.Linear(config.hidden_dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class Projector(nn.Module):
    """Voxtral's connector: `stack` frames' features -> linear, GeLU, linear, both without bias."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        self.linear_1 = nn.Linear(config.dim * config.stack, config.text_dim, bias=False)
        self.linear_2 = nn.Linear(config.text_dim, config.text_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class AudioEncoder(nn.Module):
    """float32 log-mel [1, n_mels, frames] -> audio embeddings [1, tokens_per_chunk, text_dim]."""

    def __init__(self, config: AudioConfig):
        super().__init__()
        self.config = config
        self.conv1 = nn.Conv1d(config.n_mels, config.dim, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(config.dim, config.dim, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.positions, config.dim)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.n_layers))
        self.layer_norm = nn.LayerNorm(config.dim, eps=config.norm_eps)
        self.projector = Projector(config)

    def features(self, mel: torch.Tensor) -> torch.Tensor:
        """The encoder's last hidden state, [1, positions, dim]."""
        h = F.gelu(self.conv2(F.gelu(self.conv1(mel)))).transpose(1, 2)
        h = h + self.embed_positions.weight
        for layer in self.layers:
            h = layer(h)
        return self.layer_norm(h)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        h = self.features(mel)
        return self.projector(h.reshape(1, self.config.tokens_per_chunk, self.config.dim * self.config.stack))


class AudioLanguageModel(nn.Module):
    """The text decoder and the audio tower side by side: the one module every method of a speech
    program wraps, so the methods name (and share) the same tensors."""

    def __init__(self, decoder: nn.Module, audio: AudioEncoder):
        super().__init__()
        self.decoder, self.audio = decoder, audio
