"""A GGUF's Q4_0 tensors as they are stored, unpacked without loss: the int4 values and scales an
8da4w export can take as given instead of quantizing the dequantized weights again."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from genai_pipeline.checkpoints.gguf import (
    architecture,
    config_dict,
    decoder_config,
    open_reader,
    our_tensors,
    require_gguf,
)
from genai_pipeline.checkpoints.hf import empty_decoder
from genai_pipeline.models.decoder import DecoderConfig
from genai_pipeline.registry import infer_spec


def read_q4_0(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every Q4_0 tensor of a GGUF, unpacked without loss: our tensor name -> (int8 values in
    [-8, 7], shape [out, in], in our row order; float32 scales, shape [out, in // 32]), so that
    values * scales (repeated over each block of 32) equals the dequantized weight.

    A Q4_0 block of 32 weights is an fp16 scale d and 16 bytes of nibbles: weight = d * (nibble - 8),
    low nibbles are elements 0..15 of the block, high nibbles 16..31. Fused tensors are split and
    llama's q/k rows unpermuted like the weights, which moves the scales' rows along with them."""
    file = require_gguf(path)
    reader = open_reader(file)
    _, arch = architecture(reader, file)
    config = decoder_config_from(reader, file)
    _, expected = empty_decoder(config, 1)
    expected["output.weight"] = (config.vocab_size, config.dim)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for tensor in reader.tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_0:
            continue
        blocks = np.asarray(tensor.data, dtype=np.uint8)
        rows = blocks.shape[0]
        blocks = blocks.reshape(rows, -1, 18)
        scales = blocks[..., :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
        nibbles = blocks[..., 2:]
        values = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).astype(np.int8) - 8
        ours = our_tensors(arch, tensor.name, torch.from_numpy(values.reshape(rows, -1)), config, expected, file)
        # the scales' rows are split and permuted as the values' rows are
        per_block = {name: (expected[name][0], scales.shape[1]) for name in ours}
        ours_scales = our_tensors(arch, tensor.name, torch.from_numpy(scales), config, per_block, file)
        out.update({name: (ours[name], ours_scales[name]) for name in ours})
    return out


def decoder_config_from(reader, file: Path) -> DecoderConfig:
    """A DecoderConfig from the metadata alone (no registry entry): the entry infer_spec picks."""
    return decoder_config(infer_spec(config_dict(reader, file)), reader, file)
