"""llama2.c checkpoints: a folder holding one `*.pt` and `tokenizer.model` (SentencePiece).

The `.pt` is what llama2.c's train.py saves with torch.save: `{"model": state dict, "model_args":
sizes, ...}`. It is read with `weights_only=True` (plain tensors and numbers, no code runs) and
`mmap=True`, so loading holds one copy of the weights, never two.

RoPE: llama2.c (like Meta's Llama code) rotates each head's *interleaved* pairs (x[2i], x[2i+1])
as complex numbers; our decoder rotates *halves* (x[i], x[i + d/2]), the Hugging Face convention.
Permuting the rows of wq and wk per head, so that row 2i moves to i and row 2i+1 to i + d/2,
puts every pair where rotate-half expects it: q and k then come out in that permuted order, both
rotated by the same angles as before. Attention scores are dot products of q and k within a
head, and those do not change when both are permuted alike, so the model computes the same
function; v and wo are untouched. This is the permutation of Hugging Face's
convert_llama_weights_to_hf.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from genai_pipeline.checkpoints.hf import assign_weights, check_float, empty_decoder
from genai_pipeline.errors import CheckpointError
from genai_pipeline.models.decoder import Decoder, DecoderConfig
from genai_pipeline.registry import ModelSpec

# Non-weights some llama2.c versions saved: RoPE tables and the causal mask of the non-flash
# attention path. Ours are computed by the decoder.
IGNORED = re.compile(r"freqs_(cos|sin|cis)|layers\.\d+\.attention\.mask")
# train.py saves the state dict of the torch.compile'd model, whose names carry this prefix.
COMPILED_PREFIX = "_orig_mod."


def checkpoint_file(folder: Path) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(
            f"checkpoint folder '{folder}' does not exist; pass --checkpoint DIR with a llama2.c folder (*.pt + tokenizer.model)"
        )
    files = sorted(folder.glob("*.pt"))
    if not files:
        raise CheckpointError(
            f"'{folder}' has no *.pt file; a llama2.c checkpoint folder holds one (e.g. stories15M.pt) and tokenizer.model"
        )
    if len(files) > 1:
        raise CheckpointError(
            f"'{folder}' holds several *.pt files ({', '.join(f.name for f in files)}); keep the one to export"
        )
    return files[0]


def read_checkpoint(folder: Path) -> tuple[Path, dict[str, torch.Tensor], dict]:
    """(the .pt file, its state dict with llama2.c's names, its model_args), tensors memory-mapped."""
    file = checkpoint_file(folder)
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises several types for a damaged or foreign file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(
            f"cannot read '{file}': {reason}; the file is truncated or not a llama2.c checkpoint"
        ) from None
    if (
        not isinstance(saved, dict)
        or not isinstance(saved.get("model"), dict)
        or not isinstance(saved.get("model_args"), dict)
    ):
        raise CheckpointError(
            f"'{file}' is not a llama2.c checkpoint: it needs a dict with 'model' (the state dict) and 'model_args', "
            "as llama2.c's train.py saves"
        )
    state = {}
    for key, tensor in saved["model"].items():
        key = key.removeprefix(COMPILED_PREFIX)
        if not IGNORED.fullmatch(key):
            state[key] = tensor
    return file, state, saved["model_args"]


def read_model_args(folder: Path) -> tuple[Path, dict]:
    file, _, model_args = read_checkpoint(folder)
    return file, model_args


def decoder_config(spec: ModelSpec, file: Path, model_args: dict) -> DecoderConfig:
    """The checkpoint's own model_args are the truth for its shapes."""
    try:
        return spec.config_from_checkpoint(model_args)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"the model_args of '{file}' do not describe a llama2.c model: {e!r}") from None


def interleaved_to_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q or k projection [n_heads * head_dim, dim], reordered per head from interleaved
    RoPE pairs (2i, 2i+1) to rotate-half pairs (i, i + head_dim/2). A new tensor (owns its storage)."""
    rows, cols = weight.shape
    head_dim = rows // n_heads
    return weight.reshape(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def _tied(state: dict[str, torch.Tensor]) -> bool:
    """llama2.c ties the output layer to the embedding: the saved state holds one tensor under both
    names (or only the embedding). A checkpoint whose two tensors differ is untied."""
    output, embedding = state.get("output.weight"), state.get("tok_embeddings.weight")
    if output is None or embedding is None:
        return True
    if output.shape != embedding.shape:
        return False
    return output.data_ptr() == embedding.data_ptr() or torch.equal(output, embedding)


def load_decoder(spec: ModelSpec, folder: Path, max_seq_len: int) -> Decoder:
    """Build the decoder on the meta device and assign every tensor from the checkpoint once."""
    file, state, model_args = read_checkpoint(folder)
    config = decoder_config(spec, file, model_args)
    if not _tied(state):
        config = dataclasses.replace(config, tie_embeddings=False)
    model, expected = empty_decoder(config, max_seq_len)
    ours: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        names = spec.map_key(key)
        if names == ("output.weight",) and "output.weight" not in expected:
            continue  # the tied head saved under its own name too: the embedding is the head
        if len(names) != 1 or names[0] not in expected:
            raise CheckpointError(
                f"unexpected tensor '{key}' in '{file.name}' for a llama2.c model with these model_args"
            )
        name = names[0]
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"tensor '{key}' in '{file.name}' has shape {tuple(tensor.shape)}, but its model_args imply {expected[name]}"
            )
        check_float(tensor, key, file.name)
        ours[name] = _as_ours(name, tensor, config)
    return assign_weights(model, ours, expected, file)


def _as_ours(name: str, tensor: torch.Tensor, config: DecoderConfig) -> torch.Tensor:
    tensor = tensor.to(torch.float32)
    if name.endswith("attention.wq.weight"):
        return interleaved_to_halves(tensor, config.n_heads)
    if name.endswith("attention.wk.weight"):
        return interleaved_to_halves(tensor, config.n_kv_heads)
    return tensor
