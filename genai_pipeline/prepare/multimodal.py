"""prepare, for a vision-language entry: one program whose methods are the three components
ExecuTorch's MultimodalRunner calls, `token_embedding`, `text_decoder` and `vision_encoder`; or,
with `split`, one program per component (the layout NPU backends use).

The text decoder is the same `Decoder` the text path exports, entered through its
`forward_embeddings`; every method wraps the same `VisionLanguageModel`, so the methods name the
same tensors and the program stores each weight once (the token embedding and a tied head too).
A split program's graphs wrap only their component, so each program holds only its tensors: a
tied head's table is then stored twice, in token_embedding.pte and in text_decoder.pte.

A family whose text decoder must know an image's rows (Gemma 3's two-way image attention,
Qwen2.5-VL's M-RoPE) has more columns in the embeddings its programs pass around
(models/image_rows.py): the two inputs of ExecuTorch's runner stay the same.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from torch import nn
from torch.export import Dim

from genai_pipeline.artifacts import Artifact, GraphBundle, PreparedModel
from genai_pipeline.chat_template import read_chat_template
from genai_pipeline.checkpoints.multimodal import load_multimodal, random_multimodal, vision_config
from genai_pipeline.checkpoints.processor import ProcessorFiles, image_processing
from genai_pipeline.checkpoints.special_tokens import read_special_tokens
from genai_pipeline.errors import CheckpointError, InputError
from genai_pipeline.image_processing import ImageProcessing
from genai_pipeline.models.decoder import Decoder
from genai_pipeline.models.image_rows import COLUMNS, image_columns, split_columns, text_columns
from genai_pipeline.models.vision import VisionLanguageModel
from genai_pipeline.models.vision_config import VisionConfig
from genai_pipeline.names import ArtifactKey, GraphName, Mode
from genai_pipeline.prepare.common import decoder_constants
from genai_pipeline.registry import ModelSpec, sized_as
from genai_pipeline.tokenizer import find_tokenizer_file

log = logging.getLogger(__name__)


class TokenEmbeddingGraph(nn.Module):
    """The embeddings of token ids, with the columns of `kind` (models/image_rows.py)."""

    def __init__(self, model: nn.Module, kind: str = "none"):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return text_columns(self.model.decoder.embed(tokens), self.kind)


class TextDecoderGraph(nn.Module):
    """The decoder on embeddings with the columns of `kind`, which its masks or positions read."""

    def __init__(self, model: nn.Module, kind: str = "none"):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, embeddings: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        if isinstance(self.model, VisionLanguageModel):
            return self.model.decode(embeddings, input_pos)
        embeddings, columns = split_columns(embeddings, self.kind)  # a split program: no M-RoPE
        flags = None if columns is None else columns[..., 0]
        return self.model.decoder.forward_embeddings(embeddings, input_pos, last_only=True, image_tokens=flags)


class VisionEncoderGraph(nn.Module):
    """An image's embeddings, with the columns of `kind`."""

    def __init__(self, model: nn.Module, kind: str = "none"):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if isinstance(self.model, VisionLanguageModel):
            return self.model.image_rows(pixels)
        return image_columns(self.model.vision(pixels), self.kind, grid_cols=1)  # a split program: no M-RoPE


def image_input(vision: VisionConfig) -> tuple[tuple[torch.Tensor], tuple | None]:
    """The vision encoder's example input, uint8 [1, 3, S, S], and its dynamic shapes: a tower
    whose grid follows the image (Qwen2.5-VL's merger) takes H and W in multiples of patch x merge
    px, from two units to S (image_processing.py resizes into that range)."""
    size = vision.image_size
    example = (torch.zeros((1, 3, size, size), dtype=torch.uint8),)
    if vision.connector != "merger":
        return example, None
    unit = vision.patch_size * vision.scale_factor
    rows, cols = Dim("image_rows", min=2, max=size // unit), Dim("image_cols", min=2, max=size // unit)
    return example, ({2: unit * rows, 3: unit * cols},)


def text_graphs(model: nn.Module, max_seq_len: int, kind: str = "none") -> dict[GraphName, GraphBundle]:
    """`token_embedding` and `text_decoder` of any multimodal model (one with a `decoder`), their
    embeddings with the columns of `kind`."""
    seq = Dim("seq_len", min=1, max=max_seq_len)
    dim = model.decoder.config.dim + COLUMNS[kind]
    return {
        GraphName.TOKEN_EMBEDDING: GraphBundle(
            GraphName.TOKEN_EMBEDDING,
            TokenEmbeddingGraph(model, kind),
            (torch.zeros((1, 2), dtype=torch.long),),
            dynamic_shapes=({1: seq},),
        ),
        GraphName.TEXT_DECODER: GraphBundle(
            # input_pos [1]: MultimodalRunner then passes the start position, not a range
            GraphName.TEXT_DECODER,
            TextDecoderGraph(model, kind),
            (torch.zeros((1, 2, dim)), torch.tensor([0], dtype=torch.long)),
            dynamic_shapes=({1: seq}, None),
        ),
    }


def multimodal_graphs(model: VisionLanguageModel, max_seq_len: int) -> dict[GraphName, GraphBundle]:
    example, dynamic = image_input(model.vision.config)
    return {
        **text_graphs(model, max_seq_len, model.rows_kind),
        GraphName.VISION_ENCODER: GraphBundle(
            GraphName.VISION_ENCODER, VisionEncoderGraph(model, model.rows_kind), example, dynamic_shapes=dynamic
        ),
    }


class TokenEmbeddingAlone(nn.Module):
    """The decoder's `embed` (the table and its scale) without the rest of the decoder."""

    embed = Decoder.embed  # reads only tok_embeddings and config

    def __init__(self, decoder: Decoder):
        super().__init__()
        self.tok_embeddings, self.config = decoder.tok_embeddings, decoder.config


def _alone(**components: nn.Module) -> nn.Module:
    """A module holding only `components`, under the names the graph wrappers read. A split
    program's graph wraps this, not the whole model: lowering keeps every buffer of the wrapped
    module, used or not (the decoder's RoPE tables would land in vision_encoder.pte)."""
    holder = nn.Module()
    for name, module in components.items():
        holder.add_module(name, module)
    return holder


def split_artifacts(model: VisionLanguageModel, options, constants: dict) -> dict[ArtifactKey, Artifact]:
    """One artifact per component. The encoder and the embedding have one method, `forward`; the
    text decoder has the text path's methods for the mode: `forward` (dynamic length) or
    `prefill_chunk` (a static chunk of embeddings) + `decode_token` (one embedding), sharing weights and KV cache."""
    seq = Dim("seq_len", min=1, max=options.max_seq_len)
    size, kind = model.vision.config.image_size, model.rows_kind
    dim = model.decoder.config.dim + COLUMNS[kind]
    pos = torch.tensor([0], dtype=torch.long)
    holders = {
        ArtifactKey.VISION_ENCODER: _alone(vision=model.vision),
        ArtifactKey.TOKEN_EMBEDDING: _alone(decoder=TokenEmbeddingAlone(model.decoder)),
        ArtifactKey.TEXT_DECODER: _alone(decoder=model.decoder),
    }
    decoder = TextDecoderGraph(holders[ArtifactKey.TEXT_DECODER], kind)
    decoder_graphs = {
        GraphName.FORWARD: GraphBundle(
            GraphName.FORWARD, decoder, (torch.zeros((1, 2, dim)), pos), dynamic_shapes=({1: seq}, None)
        ),
        GraphName.PREFILL_CHUNK: GraphBundle(
            GraphName.PREFILL_CHUNK, decoder, (torch.zeros((1, options.prefill_len, dim)), pos)
        ),
        GraphName.DECODE_TOKEN: GraphBundle(GraphName.DECODE_TOKEN, decoder, (torch.zeros((1, 1, dim)), pos)),
    }
    text_constants = dict(constants, enable_dynamic_shape=options.mode is Mode.DYNAMIC)
    if options.mode is Mode.HYBRID:
        text_constants["get_prefill_len"] = options.prefill_len
    graphs = {
        ArtifactKey.VISION_ENCODER: {
            GraphName.FORWARD: GraphBundle(
                GraphName.FORWARD,
                VisionEncoderGraph(holders[ArtifactKey.VISION_ENCODER], kind),
                (torch.zeros((1, 3, size, size), dtype=torch.uint8),),
            )
        },
        ArtifactKey.TOKEN_EMBEDDING: {
            GraphName.FORWARD: GraphBundle(
                GraphName.FORWARD,
                TokenEmbeddingGraph(holders[ArtifactKey.TOKEN_EMBEDDING], kind),
                (torch.zeros((1, 2), dtype=torch.long),),
                dynamic_shapes=({1: seq},),
            )
        },
        ArtifactKey.TEXT_DECODER: {name: decoder_graphs[name] for name in options.mode.graphs},
    }
    return {
        key: Artifact(key, holders[key], graphs[key], text_constants if key is ArtifactKey.TEXT_DECODER else {})
        for key in (ArtifactKey.VISION_ENCODER, ArtifactKey.TOKEN_EMBEDDING, ArtifactKey.TEXT_DECODER)
    }


def runner_vocab_size(tokenizer: Path | None) -> int | None:
    """How many ids ExecuTorch's runners sample from: pytorch_tokenizers counts the vocabulary's
    entries plus added tokens (not max id + 1)."""
    if tokenizer is None or tokenizer.suffix != ".json":
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer)).get_vocab_size(with_added_tokens=True)


def check_sampleable(ids: dict[str, int | None], runner_vocab: int | None, logits: int) -> None:
    """Special tokens a stock runner could never sample (ids at or past its vocabulary count, or
    past the logits' width) are named at export: generation there would not stop at them."""
    if runner_vocab is None:
        return
    limit = min(runner_vocab, logits)
    bad = {name: i for name, i in ids.items() if i is not None and i >= limit}
    if bad:
        log.warning(
            "special token(s) %s are at or past id %d: ExecuTorch's MultimodalRunner samples only ids below the tokenizer's "
            "entry count (%d) and the logits' width (%d), so it can never produce them",
            ", ".join(f"{k}={v}" for k, v in bad.items()),
            limit,
            runner_vocab,
            logits,
        )


def read_processing(spec: ModelSpec, checkpoint: Path | None) -> tuple[ImageProcessing, VisionConfig]:
    """The image processor's parameters and the tower's config: the checkpoint's files, the entry
    filling what they lack; `<image>` tokens per frame are the tower's (a processor file that
    states another number is refused)."""
    files = ProcessorFiles.read(checkpoint)
    processing = image_processing(spec.vision.preprocessing, files)
    vision = vision_config(spec, checkpoint, processing, files.origin)
    stated = files.tokens_per_image
    if stated is not None and stated != vision.tokens_per_image:
        raise CheckpointError(
            f"the processor expands an image into {stated} tokens ('{checkpoint}/processor_config.json') but the "
            f"image tower makes {vision.tokens_per_image} (config.json); fix the one that does not describe the model"
        )
    return dataclasses.replace(processing, tokens_per_image=vision.tokens_per_image), vision


def load_model_and_tokens(spec: ModelSpec, options, checkpoint: Path | None, tower):
    """A multimodal model with its `tower` (VisionConfig or AudioConfig): the checkpoint's weights,
    else random ones (said loudly); its tokenizer file, special tokens and the count of ids a stock
    runner samples from. Returns (spec with the checkpoint's sizes and special ids, model, weights,
    tokenizer file, special tokens, runner vocabulary)."""
    if checkpoint is not None:
        log.info("loading %s from %s", spec.name, checkpoint)
        model = load_multimodal(spec, checkpoint, options.max_seq_len, tower)
        if checkpoint != spec.checkpoint:
            spec = sized_as(spec, model.decoder.config)
        weights = str(checkpoint)
    else:
        log.warning(
            "%s: no checkpoint given, using RANDOM weights (seed %d); pass --checkpoint DIR for real weights",
            spec.name,
            options.seed,
        )
        model = random_multimodal(spec.config, tower, options.max_seq_len, options.seed)
        weights = "random"
    tokenizer = find_tokenizer_file(checkpoint) if checkpoint is not None else None
    template = read_chat_template(checkpoint) if tokenizer is not None else None
    special = read_special_tokens(
        checkpoint if tokenizer else None,
        template.source if template else spec.chat_template,
        spec.bos_id,
        spec.eos_ids,
    )
    spec = dataclasses.replace(spec, bos_id=special.bos_id, eos_ids=special.eos_ids)
    runner_vocab = runner_vocab_size(tokenizer)
    check_sampleable(
        {**{f"eos[{i}]": e for i, e in enumerate(spec.eos_ids)}, "bos": spec.bos_id},
        runner_vocab,
        model.decoder.config.vocab_size,
    )
    return spec, model, weights, tokenizer, special, runner_vocab


def prepare_multimodal(spec: ModelSpec, options) -> PreparedModel:
    """`options`: options.PrepareOptions. In one program the text decoder runs with a dynamic
    length (the runner's convention), whatever --mode says; split, it takes --mode dynamic or hybrid."""
    if options.split and options.mode is Mode.KV:
        raise InputError("--split takes --mode dynamic (one forward method) or hybrid (prefill + decode)")
    if options.split and options.mode is Mode.HYBRID and spec.vision.config.bidirectional_image_attention:
        raise InputError(
            f"{spec.name}'s image tokens attend to each other both ways, which a chunked prefill would cut "
            "apart; use --split --mode dynamic (or no --split)"
        )
    if not options.split and options.mode is not Mode.DYNAMIC:
        log.info(
            "the text decoder of a vision-language model has one dynamic-length method (ExecuTorch's runner convention); "
            "--split gives it --mode %s",
            options.mode.value,
        )
        options = dataclasses.replace(options, mode=Mode.DYNAMIC)
    checkpoint = Path(options.checkpoint) if options.checkpoint else spec.checkpoint  # shipped weights (reference-vlm)
    processing, vision = read_processing(spec, checkpoint)
    spec, model, weights, tokenizer, special, runner_vocab = load_model_and_tokens(spec, options, checkpoint, vision)
    config = model.decoder.config
    if options.split and model.mrope is not None:
        raise InputError(
            f"{spec.name}: M-RoPE positions are kept in buffers the program's methods share, which separate "
            "programs cannot; export it without --split"
        )
    # Idefics3 names it image_token_id, LLaVA image_token_index
    image_token_id = int(
        read_config_value(
            checkpoint,
            "image_token_id",
            read_config_value(checkpoint, "image_token_index", spec.vision.image_token_id),
        )
    )
    _check_image_token(tokenizer, processing.image_token, image_token_id)
    constants = decoder_constants(spec, config, options.max_seq_len, options.max_seq_len)
    params = {
        ArtifactKey.VISION_ENCODER: vision.num_params,
        ArtifactKey.TOKEN_EMBEDDING: config.vocab_size * config.dim,
        ArtifactKey.TEXT_DECODER: config.num_params - config.vocab_size * config.dim,
    }
    if options.split:
        artifacts = split_artifacts(model, options, constants)
        components = {
            key.value: {"file": f"{key.value}.pte", "methods": [g.value for g in a.graphs], "params": params[key]}
            for key, a in artifacts.items()
        }
    else:
        artifact = Artifact(ArtifactKey.MULTIMODAL, model, multimodal_graphs(model, options.max_seq_len), constants)
        artifacts = {artifact.key: artifact}
        components = {
            key.value: {"file": f"{artifact.key.value}.pte", "method": key.value, "params": n}
            for key, n in params.items()
        }
    section = {
        "layout": "split" if options.split else "one program",
        "components": components,
        "config": dataclasses.asdict(vision),
        "image_size": vision.image_size,
        "tokens_per_image": vision.tokens_per_image,
        "image_token_id": image_token_id,
        # What a runner that does not tokenize them needs (a C++ NPU runner): the ids of the
        # tokens the prompt expansion writes around each frame.
        "special_token_ids": _image_token_ids(tokenizer, processing),
        "runner_vocab_size": runner_vocab,
        "preprocessing": dataclasses.asdict(processing),
    }
    return PreparedModel(
        spec=spec,
        config=config,
        artifacts=artifacts,
        options=options,
        weights=weights,
        tokenizer_file=tokenizer,
        special_tokens=special,
        vision=section,
    )


def _check_image_token(tokenizer: Path | None, token: str, image_token_id: int) -> None:
    """The tokenizer must spell `<image>` as the id whose positions take the image's embeddings."""
    if tokenizer is None or tokenizer.suffix != ".json":
        return
    from tokenizers import Tokenizer

    found = Tokenizer.from_file(str(tokenizer)).token_to_id(token)
    if found != image_token_id:
        raise CheckpointError(
            f"config.json's image_token_id is {image_token_id} but {tokenizer.name} gives {token} the id {found}; "
            "the tokenizer does not belong to this model"
        )


def _image_token_ids(tokenizer: Path | None, processing: ImageProcessing) -> dict[str, int] | None:
    """The tokenizer's ids of the expansion's single-token markers (`<image>`, `<global-img>`, ...)."""
    if tokenizer is None or tokenizer.suffix != ".json":
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    tokens = (processing.image_token, processing.image_start, processing.image_end)
    if processing.kind == "idefics3":
        tokens += (processing.fake_image_token, processing.global_image_token)
    ids = {t: tok.token_to_id(t) for t in tokens if t}
    return {t: i for t, i in ids.items() if i is not None}


def read_config_value(folder: Path | None, key: str, default):
    if folder is None:
        return default
    from genai_pipeline.checkpoints.hf import read_config

    return read_config(folder).get(key, default)
