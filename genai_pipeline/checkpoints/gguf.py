"""llama.cpp GGUF files: `--checkpoint FILE.gguf`, or a folder holding exactly one .gguf.

A GGUF holds what a Hugging Face folder spreads over several files: hyperparameters and the
vocabulary as metadata, and the weights, often quantized (Q4_0, Q8_0, K-quants ...). We read it
with the `gguf` package's memory-mapped reader and hand the rest of the pipeline what a Hugging
Face folder would have given it:
- `config_dict`: the metadata as a config.json dict (`model_type`, `hidden_size`, ...), so the
  registry's `infer_spec` and each family's `config_from_checkpoint` read it unchanged;
- `gguf_vocab.checkpoint_folder`: config.json, tokenizer.json, tokenizer_config.json and
  generation_config.json written into a temporary folder (no weights), so special tokens, the
  tokenizer copy and the chat template are read from a normal folder downstream;
- `open_decoder`: the decoder on the meta device and a BlockLoader that dequantizes a block's
  tensors to float32 from the memory-mapped file when asked (block_loader.py), as `hf.py` reads a
  folder: an export holds one block in float, not the model; `load_decoder` reads them all.

The tensor names and metadata keys of each architecture, and what llama.cpp's converter changed:
`gguf_archs.py`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from genai_pipeline.checkpoints.block_loader import BlockLoader
from genai_pipeline.checkpoints.gguf_archs import (
    ARCHS,
    CONFIG_KEYS,
    DERIVED_TENSORS,
    SUPPORTED_TYPES,
    TOKEN_ID_KEYS,
    Arch,
)
from genai_pipeline.checkpoints.gguf_checks import check_blocks, check_layout, check_metadata, check_token_id, whole
from genai_pipeline.checkpoints.hf import empty_decoder, refuse_non_finite
from genai_pipeline.checkpoints.llama2c import interleaved_to_halves
from genai_pipeline.errors import CheckpointError
from genai_pipeline.models.decoder import Decoder, DecoderConfig
from genai_pipeline.registry import ModelSpec
from genai_pipeline.upstream.gguf_reader import gguf_reader

# -- reading -------------------------------------------------------------------------------------


def gguf_file(path: Path) -> Path | None:
    """The GGUF a --checkpoint names: a .gguf file, or the only .gguf of a folder without
    config.json (a Hugging Face folder stays one); None if it names no GGUF."""
    path = Path(path)
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise CheckpointError(
            f"'{path}' holds several .gguf files ({', '.join(f.name for f in files)}); pass --checkpoint the one to export"
        )
    return files[0] if files else None


def open_reader(file: Path):
    """The memory-mapped reader of a GGUF; any failure of the reader becomes one CheckpointError.
    Cached: an export reads one file up to three times (entry, metadata folder, weights), and
    parsing a 150k-token vocabulary takes seconds."""
    file = Path(file)
    if not file.is_file():
        raise CheckpointError(f"GGUF file '{file}' does not exist")
    stat = file.stat()
    return _reader(str(file.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _reader(file: str, mtime_ns: int, size: int):
    check_layout(Path(file))
    try:
        return gguf_reader(file)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError ... on a damaged file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"cannot read '{file}': {reason}; the file is truncated or not a GGUF") from None


def metadata(reader, key: str, default=None):
    """One metadata value (a string, number or list), or `default` when the file has none."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception as e:  # a damaged field
        raise CheckpointError(f"GGUF metadata '{key}' cannot be read ({e})") from None


def architecture(reader, file: Path) -> tuple[str, Arch]:
    name = metadata(reader, "general.architecture")
    if not isinstance(name, str) or name not in ARCHS:
        raise CheckpointError(
            f"'{file}' is a GGUF of architecture '{name}', which this pipeline does not read; supported: {', '.join(ARCHS)}"
        )
    return name, ARCHS[name]


def config_dict(reader, file: Path) -> dict:
    """The GGUF's metadata as the config.json Hugging Face would have written for the model."""
    name, arch = architecture(reader, file)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError(f"'{file}' has no token_embd.weight tensor")
    config: dict = {"model_type": arch.model_type, **dict(arch.defaults)}
    config_keys = {**CONFIG_KEYS, **dict(arch.config_keys)}
    for key, ours in config_keys.items():
        value = metadata(reader, f"{name}.{key}")
        if name == "lfm2" and key == "attention.head_count_kv" and isinstance(value, list):
            config["layer_types"] = ["full_attention" if heads else "conv" for heads in value]
            value = max(value, default=0)  # the attention layers' count (0: a convolution layer)
        if isinstance(value, list):  # per-layer values (some files): ours are uniform
            if len(set(map(repr, value))) != 1:
                raise CheckpointError(
                    f"'{file}' has per-layer {name}.{key} {value}, which this pipeline does not support"
                )
            value = value[0]
        if value is not None and not (ours == "sliding_window" and not value):  # 0: none (llama.cpp's Phi-4)
            config[ours] = value
    missing = [
        k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size") if k not in config
    ]
    if missing:
        raise CheckpointError(f"'{file}' lacks metadata for {', '.join(missing)} of its {name} architecture")
    check_metadata(name, config, tensors, file, config_keys)
    # The embedding's rows are the truth for the vocabulary size (some files pad the token list).
    config["vocab_size"] = int(tensors["token_embd.weight"].shape[-1])
    config["tie_word_embeddings"] = "output.weight" not in tensors
    _rope_config(reader, name, config, tensors, file)
    if name == "gemma3":
        _gemma3_config(reader, config)
    if name == "lfm2":  # the width the MLP uses, and LFM2's name for the norms' epsilon
        config.update(block_auto_adjust_ff_dim=False, norm_eps=config.get("rms_norm_eps", 1e-5))
    for key, ours in TOKEN_ID_KEYS.items():
        value = metadata(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config[ours] = check_token_id(f"tokenizer.ggml.{key}", value, config["vocab_size"], file)
    return config


def _rope_config(reader, name: str, config: dict, tensors: dict, file: Path) -> None:
    """Partial rotary (rope.dimension_count < head_dim: Phi) and RoPE scaling, as config.json
    spells them. llama.cpp keeps Llama 3's and LongRoPE's per-frequency factors as tensors."""
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    rope_dim = metadata(reader, f"{name}.rope.dimension_count")
    if rope_dim is not None and not (whole(rope_dim) and 0 < rope_dim <= head_dim and rope_dim % 2 == 0):
        raise CheckpointError(
            f"'{file}': {name}.rope.dimension_count is {rope_dim!r}; expected an even whole number "
            f"in (0, {head_dim}], the head size"
        )
    if rope_dim is not None and int(rope_dim) != head_dim:
        config["partial_rotary_factor"] = int(rope_dim) / head_dim
    original = metadata(reader, f"{name}.rope.scaling.original_context_length")
    if "rope_factors_long.weight" in tensors:  # Phi-3 LongRoPE
        config["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": _dequantize(tensors["rope_factors_long.weight"], file).tolist(),
            "short_factor": _dequantize(tensors["rope_factors_short.weight"], file).tolist(),
            **({"attention_factor": attn} if (attn := metadata(reader, f"{name}.rope.scaling.attn_factor")) else {}),
        }
        config["original_max_position_embeddings"] = int(original or config["max_position_embeddings"])
    elif "rope_freqs.weight" in tensors:  # Llama 3.x
        config["rope_scaling"] = _llama3_rope(_dequantize(tensors["rope_freqs.weight"], file), config, head_dim, file)
    elif (kind := metadata(reader, f"{name}.rope.scaling.type")) not in (None, "none"):
        # config_from_checkpoint names and refuses what our decoder does not implement (linear, yarn)
        config["rope_scaling"] = {"rope_type": kind, "factor": metadata(reader, f"{name}.rope.scaling.factor", 1.0)}


# Llama 3.1/3.2's RoPE scaling constants (all of Meta's releases); llama.cpp keeps only the
# frequency divisors they produce (rope_freqs), so we take these and check they reproduce them.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama3_rope(divisors: np.ndarray, config: dict, head_dim: int, file: Path) -> dict:
    from genai_pipeline.models.decoder import RopeScaling

    params = {"rope_type": "llama3", "factor": float(divisors.max()), **LLAMA3_ROPE}
    theta = float(config.get("rope_theta", 10000.0))
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    scaling = RopeScaling(**{k: v for k, v in params.items() if k != "rope_type"})
    expected = (inv_freq / scaling.scale(inv_freq, 0)).numpy()
    if expected.shape != divisors.shape or not np.allclose(expected, divisors, rtol=1e-3):
        raise CheckpointError(
            f"'{file}' has RoPE frequency factors (rope_freqs) that are not Llama 3's scaling; this pipeline cannot read them"
        )
    return params


def _gemma3_config(reader, config: dict) -> None:
    pattern = metadata(reader, "gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag per layer (newer files): True = sliding
        config["layer_types"] = ["sliding_attention" if flag else "full_attention" for flag in pattern]
    else:
        config["sliding_window_pattern"] = int(pattern)
    config["rope_local_base_freq"] = float(metadata(reader, "gemma3.rope.freq_base_swa", 10000.0))
    head_dim = int(config.get("head_dim") or 256)
    # llama.cpp scales attention by 1/sqrt(head_dim), but by 1/sqrt(hidden / heads) for the 62-layer 27B
    config["query_pre_attn_scalar"] = (
        config["hidden_size"] // config["num_attention_heads"] if config["num_hidden_layers"] == 62 else head_dim
    )


def read_config(path: Path) -> dict:
    """config.json-equivalent dict of a .gguf file (or folder holding one)."""
    file = require_gguf(path)
    return config_dict(open_reader(file), file)


def require_gguf(path: Path) -> Path:
    file = gguf_file(path)
    if file is None:
        raise CheckpointError(f"'{path}' is not a .gguf file nor a folder holding one")
    return file


# -- tensors -------------------------------------------------------------------------------------


def _check_type(tensor, file: Path) -> None:
    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TYPES:
        raise CheckpointError(
            f"tensor '{tensor.name}' in '{file.name}' is {kind}, which this pipeline does not dequantize; "
            f"supported: {', '.join(SUPPORTED_TYPES)}"
        )


def _dequantize(tensor, file: Path) -> np.ndarray:
    """float32 [rows, cols] (numpy order: GGUF lists shapes innermost first) of one tensor."""
    import gguf

    _check_type(tensor, file)
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except Exception as e:  # a damaged tensor
        raise CheckpointError(
            f"cannot dequantize tensor '{tensor.name}' ({tensor.tensor_type.name}) in '{file.name}': {e}"
        ) from None
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if np.may_share_memory(values, tensor.data):  # F32 comes back as a view of the memory-mapped file
        values = values.copy()  # the model owns its weights; the file may close
    return values.astype(np.float32, copy=False).reshape(shape)


def _unpermute(name: str, rows: torch.Tensor, config: DecoderConfig) -> torch.Tensor:
    """llama.cpp's q/k row order (interleaved RoPE pairs per head) back to rotate-half order; the
    same permutation as llama2.c's, for weights [rows, cols] and biases [rows] alike."""
    heads = config.n_heads if ".wq." in name else config.n_kv_heads
    flat = rows.reshape(rows.shape[0], -1)
    return interleaved_to_halves(flat, heads).reshape(rows.shape)


def checked_names(arch: Arch, tensor_name: str, shape: tuple[int, ...], expected: dict, file: Path) -> tuple[str, ...]:
    """Our tensors a GGUF tensor of this (numpy-order) shape holds, refused unless the metadata
    imply them and that shape; () for a tied head stored anyway."""
    names = arch.map_tensor(tensor_name)
    if names == ("output.weight",) and "output.weight" not in expected:
        return ()
    if not names or any(n not in expected for n in names):
        raise CheckpointError(
            f"unexpected tensor '{tensor_name}' in '{file.name}' for a {arch.model_type} model with its metadata"
        )
    shapes = [expected[n] for n in names]
    want = (sum(s[0] for s in shapes), *shapes[0][1:])
    if names[0].endswith(".conv.conv_weight") and len(shape) == 2:
        shape = (shape[0], 1, shape[1])  # llama.cpp squeezes the depthwise convolution's unit dimension
    if tuple(shape) != want:
        raise CheckpointError(
            f"tensor '{tensor_name}' in '{file.name}' has shape {tuple(shape)}, but its metadata imply {want}"
        )
    return names


def our_tensors(
    arch: Arch, tensor_name: str, values: torch.Tensor, config: DecoderConfig, expected: dict, file: Path
) -> dict[str, torch.Tensor]:
    """A GGUF tensor (dequantized) as ours: split if fused, norms unshifted, q/k rows unpermuted."""
    names = checked_names(arch, tensor_name, tuple(values.shape), expected, file)
    if not names:
        return {}  # a tied head stored anyway: the embedding is the head
    shapes = [expected[n] for n in names]
    if values.dim() == 2 and len(shapes[0]) == 3:
        values = values.unsqueeze(1)  # llama.cpp squeezes the depthwise convolution's unit dimension
    if arch.norm_shift and tensor_name.endswith("norm.weight"):
        values = values - arch.norm_shift
    pieces = values.split([s[0] for s in shapes], dim=0) if len(names) > 1 else (values,)
    out = {}
    for name, piece in zip(names, pieces):
        if arch.permuted_qk and (".wq." in name or ".wk." in name):
            piece = _unpermute(name, piece, config)
        out[name] = piece.contiguous() if len(names) == 1 else piece.clone()  # a part owns its storage
    return out


def decoder_config(spec: ModelSpec, reader, file: Path) -> DecoderConfig:
    config = config_dict(reader, file)
    try:
        return spec.config_from_checkpoint(config)
    except CheckpointError as e:  # names what config.json (here: the metadata) asks for
        raise CheckpointError(f"the metadata of '{file}': {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"the metadata of '{file}' do not describe a {spec.family} model: {e!r}") from None


def load_decoder(spec: ModelSpec, path: Path, max_seq_len: int) -> Decoder:
    """The decoder with every tensor, dequantized one GGUF tensor at a time."""
    model, weights = open_decoder(spec, path, max_seq_len)
    weights.load_all(model)
    return model


def open_decoder(spec: ModelSpec, path: Path, max_seq_len: int) -> tuple[Decoder, BlockLoader]:
    """The decoder on the meta device and what dequantizes its tensors when asked, a block at a
    time. Every tensor's name, type and shape are checked here, from the file's header; values
    when they are read."""
    file = require_gguf(path)
    reader = open_reader(file)
    _, arch = architecture(reader, file)
    config = decoder_config(spec, reader, file)
    check_blocks(arch.model_type, config.n_layers, [t.name for t in reader.tensors], file)
    model, expected = empty_decoder(config, max_seq_len)
    index = {}  # our tensor -> the GGUF tensor holding it
    for tensor in reader.tensors:
        if DERIVED_TENSORS.fullmatch(tensor.name):
            continue
        _check_type(tensor, file)
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        index.update(dict.fromkeys(checked_names(arch, tensor.name, shape, expected, file), tensor))
    missing = sorted(set(expected) - set(index))
    if missing:
        raise CheckpointError(
            f"checkpoint '{file}' lacks tensor(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )

    def read(names) -> dict[str, torch.Tensor]:
        state = {}
        for tensor in {id(index[n]): index[n] for n in names}.values():  # a fused tensor read once
            values = torch.from_numpy(_dequantize(tensor, file))
            state.update(our_tensors(arch, tensor.name, values, config, expected, file))
        state = {n: state[n] for n in names}
        refuse_non_finite(state, file)
        return state

    model.reset_buffers()
    return model.eval().requires_grad_(False), BlockLoader(read)
