"""Checkpoint folders, by the format a registry entry names (`ModelSpec.checkpoint_format`):
Hugging Face (config.json + *.safetensors, `hf.py`) and llama2.c (*.pt + tokenizer.model, `llama2c.py`);
and llama.cpp GGUF files (`gguf.py`), read whatever the entry's format, since a GGUF holds any family."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from genai_pipeline.checkpoints import gguf, gguf_vocab, hf, llama2c
from genai_pipeline.checkpoints.block_loader import BlockLoader
from genai_pipeline.errors import CheckpointError
from genai_pipeline.models.decoder import Decoder
from genai_pipeline.registry import ModelSpec, infer_llama2c_spec, infer_spec

LOADERS: dict[str, Callable[[ModelSpec, Path, int], Decoder]] = {
    "hf": hf.load_decoder,
    "llama2c": llama2c.load_decoder,
}


def load_decoder(spec: ModelSpec, folder: Path, max_seq_len: int) -> Decoder:
    """The entry's decoder with the weights of a local checkpoint: a GGUF (file, or folder holding
    one), else a folder in the entry's format."""
    if gguf.gguf_file(Path(folder)) is not None:
        return gguf.load_decoder(spec, Path(folder), max_seq_len)
    return LOADERS[spec.checkpoint_format](spec, Path(folder), max_seq_len)


def open_decoder(spec: ModelSpec, folder: Path, max_seq_len: int) -> tuple[Decoder, BlockLoader | None]:
    """load_decoder, but a Hugging Face folder's or a GGUF's weights stay in their memory-mapped
    files until the BlockLoader reads them (block_loader.py); llama2.c's come loaded (loader None)."""
    if gguf.gguf_file(Path(folder)) is not None:
        return gguf.open_decoder(spec, Path(folder), max_seq_len)
    if spec.checkpoint_format == "hf":
        return hf.open_decoder(spec, Path(folder), max_seq_len)
    return load_decoder(spec, folder, max_seq_len), None


def metadata_folder(checkpoint: Path) -> Path:
    """Where a checkpoint's tokenizer, tokenizer_config.json and generation_config.json are: the
    folder itself, or for a GGUF a temporary folder of those files converted from its metadata."""
    return (
        gguf_vocab.checkpoint_folder(checkpoint) if gguf.gguf_file(Path(checkpoint)) is not None else Path(checkpoint)
    )


def infer_checkpoint_spec(folder: Path) -> tuple[ModelSpec, str]:
    """The registry entry for a checkpoint given without a model name, and what it was read from:
    a GGUF's metadata, config.json's model_type and sizes, or a llama2.c .pt's model_args sizes."""
    folder = Path(folder)
    if (file := gguf.gguf_file(folder)) is not None:
        return infer_spec(gguf.read_config(file)), f"the metadata of {file}"
    if not folder.is_dir() or (folder / "config.json").is_file():
        config = hf.read_config(folder)
        if (
            "num_hidden_layers" in config and "vision_config" not in config
        ):  # a text model (a vision-language one nests it)
            hf.check_layer_count(
                config["num_hidden_layers"], hf.layer_indices(folder), f"{folder}/config.json: num_hidden_layers"
            )
        return infer_spec(config), f"{folder / 'config.json'}"
    if any(folder.glob("*.pt")):
        file, model_args = llama2c.read_model_args(folder)
        return infer_llama2c_spec(model_args), f"the model_args of {file}"
    raise CheckpointError(
        f"'{folder}' has neither config.json (a Hugging Face checkpoint) nor a *.pt file (a llama2.c checkpoint); "
        "pass --checkpoint a model folder"
    )
