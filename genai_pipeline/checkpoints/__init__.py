"""Checkpoint folders, by the format a registry entry names (`ModelSpec.checkpoint_format`):
Hugging Face (config.json + *.safetensors, `hf.py`) and llama2.c (*.pt + tokenizer.model, `llama2c.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from genai_pipeline.checkpoints import hf, llama2c
from genai_pipeline.errors import CheckpointError
from genai_pipeline.models.decoder import Decoder
from genai_pipeline.registry import ModelSpec, infer_llama2c_spec, infer_spec

LOADERS: dict[str, Callable[[ModelSpec, Path, int], Decoder]] = {
    "hf": hf.load_decoder,
    "llama2c": llama2c.load_decoder,
}


def load_decoder(spec: ModelSpec, folder: Path, max_seq_len: int) -> Decoder:
    """The entry's decoder with the weights of a local checkpoint folder in the entry's format."""
    return LOADERS[spec.checkpoint_format](spec, Path(folder), max_seq_len)


def infer_checkpoint_spec(folder: Path) -> tuple[ModelSpec, str]:
    """The registry entry for a checkpoint folder given without a model name, and what it was
    read from: config.json's model_type and sizes, or a llama2.c .pt's model_args sizes."""
    folder = Path(folder)
    if not folder.is_dir() or (folder / "config.json").is_file():
        return infer_spec(hf.read_config(folder)), f"{folder / 'config.json'}"
    if any(folder.glob("*.pt")):
        file, model_args = llama2c.read_model_args(folder)
        return infer_llama2c_spec(model_args), f"the model_args of {file}"
    raise CheckpointError(
        f"'{folder}' has neither config.json (a Hugging Face checkpoint) nor a *.pt file (a llama2.c checkpoint); "
        "pass --checkpoint a model folder"
    )
