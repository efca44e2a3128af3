"""Local Hugging Face checkpoint folders: config.json + *.safetensors (sharded or not).

Tensors are read lazily from memory-mapped files and handed to a model built on the meta
device, so loading holds one copy of the weights, never two.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from genai_pipeline.checkpoints.block_loader import BlockLoader
from genai_pipeline.errors import CheckpointError
from genai_pipeline.models.decoder import Decoder, DecoderConfig
from genai_pipeline.registry import ModelSpec


def read_config(folder: Path) -> dict:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(
            f"checkpoint folder '{folder}' does not exist; pass --checkpoint DIR with a local Hugging Face model folder"
        )
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"'{folder}' has no config.json; a Hugging Face checkpoint folder needs config.json and *.safetensors"
        )
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"'{path}' is not valid JSON ({e}); re-download or re-save the checkpoint") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"'{path}' must hold a JSON object")
    return config


def decoder_config(spec: ModelSpec, folder: Path) -> DecoderConfig:
    """The checkpoint's own config.json is the truth for its shapes."""
    hf = read_config(folder)
    if spec.vision is None:
        check_hyperparameters(hf, f"{folder}/config.json")
        check_layer_count(
            hf.get("num_hidden_layers"), layer_indices(folder), f"{folder}/config.json: num_hidden_layers"
        )
    try:
        return spec.config_from_checkpoint(hf)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"'{folder}/config.json' does not describe a {spec.family} model: {e!r}") from None


# config.json keys (and a GGUF's, once renamed to them) that must be whole numbers >= 1, or finite
# numbers above 0: checked before a family's reader converts them (int() would truncate 2.5)
WHOLE_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "sliding_window",
)
POSITIVE_KEYS = ("rms_norm_eps", "rope_theta")


def check_hyperparameters(config: dict, where: str, name=lambda key: key) -> None:
    """Every known size a whole number >= 1 and every known scale a finite number above 0, else one
    line naming the key (`name` spells it as the file does), its value and what was expected."""
    for key, value in config.items():
        if value is None or (key == "sliding_window" and value == 0):  # unset; 0: no window (Phi-4)
            continue
        if key in WHOLE_KEYS:
            ok, expected = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "a whole number >= 1"
        elif key in POSITIVE_KEYS:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")
            expected = "a finite number above 0"
        else:
            continue
        if not ok:
            raise CheckpointError(f"{where}: {name(key)} is {value!r}; expected {expected}")


def layer_indices(folder: Path) -> set[int]:
    """The decoder layers a text checkpoint's tensors belong to (`model.layers.N.`), from the
    safetensors headers alone."""
    indices = set()
    for file in safetensors_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                indices.update(int(m.group(1)) for key in f.keys() if (m := LAYER_KEY.search(key)))
        except Exception as e:  # safetensors raises several types for a damaged file
            raise CheckpointError(f"cannot read '{file}': {e}; the file is truncated or not safetensors") from None
    return indices


LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_layer_count(declared, present: set[int], what: str) -> None:
    """A checkpoint's declared layer count must be a whole number equal to the layers its tensors
    hold, 0 to N-1, checked before a model of that many layers is built (a file that declares a
    billion layers would otherwise fill the memory)."""
    if declared is None:
        return
    if not isinstance(declared, int) or isinstance(declared, bool) or declared < 1:
        raise CheckpointError(f"{what} is {declared!r}; expected a whole number of layers above 0")
    if len(present) != declared or present != set(range(declared)):  # the count first: range(10**9) is no set to build
        have = (
            f"layers 0 to {max(present)}"
            if present == set(range(len(present))) and present
            else f"{len(present)} layer(s) {sorted(present)[:8]}"
        )
        raise CheckpointError(f"{what} is {declared}, but the tensors hold {have}; the checkpoint is inconsistent")


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"'{index}' is corrupt ({e!r})") from None
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"'{folder}' is missing shard(s) {', '.join(missing)} named in {index.name}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"'{folder}' has no *.safetensors files; save the model with safe_serialization=True")
    return files


def load_decoder(spec: ModelSpec, folder: Path, max_seq_len: int) -> Decoder:
    """Build the decoder on the meta device and assign every tensor from the checkpoint once."""
    model, weights = open_decoder(spec, folder, max_seq_len)
    weights.load_all(model)
    return model


def open_decoder(spec: ModelSpec, folder: Path, max_seq_len: int) -> tuple[Decoder, BlockLoader]:
    """The decoder on the meta device (its RoPE tables and empty KV cache made) and what loads its
    weights from the memory-mapped files when asked, a block at a time: an export then holds one
    block in float, not the model (quantize/streaming.py). Every tensor's name, shape and dtype are
    checked here, from the files' headers; values when they are read."""
    folder = Path(folder)
    model, expected = empty_decoder(decoder_config(spec, folder), max_seq_len)
    index: dict[str, tuple[Path, str, tuple[tuple[str, tuple[int, ...]], ...]]] = {}
    for file in safetensors_files(folder):
        index.update(_index_file(spec, file, expected))
    missing = sorted(set(expected) - set(index))
    if missing:
        raise CheckpointError(
            f"checkpoint '{folder}' lacks tensor(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    model.reset_buffers()
    return model.eval().requires_grad_(False), BlockLoader(lambda names: _read(index, names, folder))


def _index_file(spec: ModelSpec, file: Path, expected: dict[str, tuple[int, ...]]) -> dict:
    """{our tensor: (file, its checkpoint key, the key's parts: (our name, shape) each)} for one
    safetensors file, every key's shape and dtype checked from the header."""
    index = {}
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                ours = spec.map_key(key)
                if ours == ("output.weight",) and "output.weight" not in expected:
                    continue  # a tied head saved anyway: the embedding is the head
                if not ours or any(name not in expected for name in ours):
                    raise CheckpointError(
                        f"unexpected tensor '{key}' in '{file.name}' for a {spec.family} model with this config.json"
                    )
                header = f.get_slice(key)
                shapes = tuple((name, expected[name]) for name in ours)
                _check_shape(tuple(header.get_shape()), key, file.name, dict(shapes))
                if not header.get_dtype().startswith(("F", "BF")):
                    raise CheckpointError(
                        _not_float(key, file.name, _DTYPES.get(header.get_dtype(), header.get_dtype()))
                    )
                index.update({name: (file, key, shapes) for name in ours})
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises several types for a damaged file
        raise CheckpointError(f"cannot read '{file}': {e}; the file is truncated or not safetensors") from None
    return index


# safetensors' header dtypes that are not float, as torch names them
_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32"}
_DTYPES |= {"U32": "uint32", "I64": "int64", "U64": "uint64"}


def _read(index: dict, names, folder: Path) -> dict[str, torch.Tensor]:
    """Our tensors `names` in float32, each checkpoint tensor read once, each checked finite."""
    wanted: dict[tuple[Path, str], tuple] = {}
    for name in names:
        file, key, shapes = index[name]
        wanted[(file, key)] = shapes
    state = {}
    for (file, key), shapes in wanted.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                tensor = f.get_tensor(key)
        except Exception as e:  # safetensors raises several types for a damaged file
            raise CheckpointError(f"cannot read '{file}': {e}; the file is truncated or not safetensors") from None
        state.update(_as_ours(tensor, key, file.name, dict(shapes)))
    state = {name: state[name] for name in names}
    refuse_non_finite(state, folder)
    return state


def empty_decoder(config: DecoderConfig, max_seq_len: int) -> tuple[Decoder, dict[str, tuple[int, ...]]]:
    """The decoder on the meta device (no memory), and the name and shape of every tensor a
    checkpoint must supply (a tied head comes with the embedding)."""
    with torch.device("meta"):
        model = Decoder(config, max_seq_len)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_embeddings:
        expected.pop("output.weight")
    return model, expected


def assign_weights(model: Decoder, state: dict[str, torch.Tensor], expected: dict, source: Path) -> Decoder:
    """A meta-device decoder given its tensors, each once (no copy); every expected one must be there."""
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(
            f"checkpoint '{source}' lacks tensor(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    refuse_non_finite(state, source)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.reset_buffers()
    return model.eval().requires_grad_(False)


def refuse_non_finite(state: dict[str, torch.Tensor], source: Path) -> None:
    """A NaN or Inf weight makes every logit NaN downstream (greedy decoding then emits token 0
    forever): refuse it here, naming the tensor, rather than export a program that cannot work."""
    for name, tensor in state.items():
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), 1 << 20):  # bounded scratch (isfinite copies its input)
            if not torch.isfinite(flat[start : start + (1 << 20)]).all():
                raise CheckpointError(
                    f"checkpoint '{source}': tensor {name} holds NaN or Inf values; the file is corrupt "
                    "(download it again)"
                )


def _as_ours(
    tensor: torch.Tensor, key: str, file_name: str, shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """A checkpoint tensor as our tensor, or as several when it is a fused one: our tensors
    concatenated along dim 0 (e.g. Phi-3's qkv_proj), split by their shapes."""
    _check_shape(tuple(tensor.shape), key, file_name, shapes)
    check_float(tensor, key, file_name)
    if len(shapes) == 1:
        return {name: tensor.to(torch.float32) for name in shapes}
    pieces = tensor.split([shape[0] for shape in shapes.values()], dim=0)
    # copies: each part owns its storage, so the fused tensor is freed and no weights alias
    return {name: piece.to(torch.float32, copy=True) for name, piece in zip(shapes, pieces)}


def _check_shape(shape: tuple[int, ...], key: str, file_name: str, shapes: dict[str, tuple[int, ...]]) -> None:
    first = next(iter(shapes.values()))
    want = (sum(s[0] for s in shapes.values()), *first[1:])
    if shape != want or any(s[1:] != first[1:] for s in shapes.values()):
        parts = f" ({' + '.join(shapes)})" if len(shapes) > 1 else ""
        raise CheckpointError(
            f"tensor '{key}' in '{file_name}' has shape {shape}, but config.json implies {want}{parts}"
        )


def check_float(tensor: torch.Tensor, key: str, file_name: str) -> None:
    """Float weights of any width are read as float32; integer ones are a quantized format
    (GPTQ/AWQ packs, bitsandbytes) whose values are not the weights."""
    if not tensor.is_floating_point():
        raise CheckpointError(_not_float(key, file_name, str(tensor.dtype).removeprefix("torch.")))


def _not_float(key: str, file_name: str, dtype: str) -> str:
    return (
        f"tensor '{key}' in '{file_name}' is {dtype}: a pre-quantized checkpoint "
        "cannot be read; pass its float (fp32/bf16/fp16) checkpoint and quantize with --recipe"
    )


def random_decoder(config: DecoderConfig, max_seq_len: int, seed: int = 0) -> Decoder:
    """Random weights (std 0.02, as HF initialises Llama), reproducible from the seed."""
    torch.manual_seed(seed)
    model = Decoder(config, max_seq_len)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or (config.tie_embeddings and name == "output.weight"):
            continue  # norms start at one; a tied head is the embedding
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.zeros_(p)
    return model.eval().requires_grad_(False)
