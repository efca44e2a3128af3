"""prepare, for a speech-language entry: one program whose methods are the three components
ExecuTorch's MultimodalRunner calls, `token_embedding`, `text_decoder` and `audio_encoder`.

The text decoder and its two methods are the vision-language path's (prepare/multimodal.py); the
audio encoder takes one chunk of log-mel features, float32 `[1, n_mels, frames]`, the layout the
runner hands `audio_encoder` (`make_audio_input`: `[batch, n_bins, n_frames]`). Every method wraps
the same `AudioLanguageModel`, so the program stores each weight once. Only this layout is built:
no `--split`, no quantized recipe (the audio tower has no recipe yet).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from torch import nn

from genai_pipeline.artifacts import Artifact, GraphBundle, PreparedModel
from genai_pipeline.audio_processing import AudioProcessing
from genai_pipeline.checkpoints.multimodal import audio_config
from genai_pipeline.checkpoints.processor import ProcessorFiles, audio_processing
from genai_pipeline.errors import CheckpointError, InputError
from genai_pipeline.models.audio import AudioConfig, AudioLanguageModel
from genai_pipeline.names import ArtifactKey, GraphName, Mode
from genai_pipeline.prepare.common import decoder_constants
from genai_pipeline.prepare.multimodal import load_model_and_tokens, read_config_value, text_graphs
from genai_pipeline.registry import ModelSpec

log = logging.getLogger(__name__)


class AudioEncoderGraph(nn.Module):
    def __init__(self, model: AudioLanguageModel):
        super().__init__()
        self.model = model

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return self.model.audio(mel)


def speech_graphs(model: AudioLanguageModel, max_seq_len: int) -> dict[GraphName, GraphBundle]:
    config = model.audio.config
    return {
        **text_graphs(model, max_seq_len),
        GraphName.AUDIO_ENCODER: GraphBundle(
            GraphName.AUDIO_ENCODER, AudioEncoderGraph(model), (torch.zeros((1, config.n_mels, config.frames)),)
        ),
    }


def read_audio_processing(spec: ModelSpec, checkpoint: Path | None) -> tuple[AudioProcessing, AudioConfig]:
    """The feature extractor's parameters and the tower's config: the checkpoint's files, the entry
    filling what they lack; audio tokens per chunk are the tower's."""
    files = ProcessorFiles.read(checkpoint)
    processing = audio_processing(spec.audio.preprocessing, files)
    audio = audio_config(spec, checkpoint, processing, files.audio_origin)
    return dataclasses.replace(processing, tokens_per_chunk=audio.tokens_per_chunk), audio


def prepare_speech(spec: ModelSpec, options) -> PreparedModel:
    """`options`: options.PrepareOptions. The text decoder runs with a dynamic length (the runner's
    convention), whatever --mode says."""
    if options.split:
        raise InputError(
            f"--split is built for vision-language models; {spec.name} (speech) exports as one program: drop --split"
        )
    if options.mode is not Mode.DYNAMIC:
        log.info("the text decoder of a speech model has one dynamic-length method (ExecuTorch's runner convention)")
        options = dataclasses.replace(options, mode=Mode.DYNAMIC)
    checkpoint = Path(options.checkpoint) if options.checkpoint else spec.checkpoint
    processing, audio = read_audio_processing(spec, checkpoint)
    spec, model, weights, tokenizer, special, runner_vocab = load_model_and_tokens(spec, options, checkpoint, audio)
    config = model.decoder.config
    audio_token_id = int(read_config_value(checkpoint, "audio_token_id", spec.audio.audio_token_id))
    token_ids = _audio_token_ids(tokenizer, processing, audio_token_id)
    constants = decoder_constants(spec, config, options.max_seq_len, options.max_seq_len)
    artifact = Artifact(ArtifactKey.MULTIMODAL, model, speech_graphs(model, options.max_seq_len), constants)
    params = {  # by method: the components of the one program
        GraphName.AUDIO_ENCODER: audio.num_params,
        GraphName.TOKEN_EMBEDDING: config.vocab_size * config.dim,
        GraphName.TEXT_DECODER: config.num_params - config.vocab_size * config.dim,
    }
    section = {
        "components": {
            key.value: {"file": f"{artifact.key.value}.pte", "method": key.value, "params": n}
            for key, n in params.items()
        },
        "config": dataclasses.asdict(audio),
        "tokens_per_chunk": audio.tokens_per_chunk,
        "audio_token_id": audio_token_id,
        # what a runner that does not tokenize them needs: the ids of the tokens each clip is written as
        "special_token_ids": token_ids,
        "runner_vocab_size": runner_vocab,
        "preprocessing": dataclasses.asdict(processing),
    }
    return PreparedModel(
        spec=spec,
        config=config,
        artifacts={artifact.key: artifact},
        options=options,
        weights=weights,
        tokenizer_file=tokenizer,
        special_tokens=special,
        audio=section,
    )


def _audio_token_ids(tokenizer: Path | None, processing: AudioProcessing, audio_token_id: int) -> dict[str, int] | None:
    """The tokenizer's ids of `[AUDIO]` and `[BEGIN_AUDIO]`; `[AUDIO]` must be config.json's audio_token_id."""
    if tokenizer is None or tokenizer.suffix != ".json":
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    ids = {t: tok.token_to_id(t) for t in (processing.audio_token, processing.audio_start)}
    if ids[processing.audio_token] != audio_token_id:
        raise CheckpointError(
            f"config.json's audio_token_id is {audio_token_id} but {tokenizer.name} gives {processing.audio_token} the id "
            f"{ids[processing.audio_token]}; the tokenizer does not belong to this model"
        )
    return {t: i for t, i in ids.items() if i is not None}
