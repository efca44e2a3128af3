"""What a GGUF is checked for before anything is built from it: its header walked with every count,
size and offset held to the file's size (the `gguf` reader trusts them), and its hyperparameters
typed and matched against the tensors it holds. Each failure is one CheckpointError naming the key
or tensor, its value and what was expected (docs/limits.md)."""

from __future__ import annotations

import contextlib
import math
import mmap
import re
import struct
from pathlib import Path

from genai_pipeline.checkpoints.hf import check_hyperparameters
from genai_pipeline.errors import CheckpointError

# GGUF value types: id -> (struct format, bytes); 8 is a string (u64 length + bytes), 9 an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4  # llama.cpp's GGML_MAX_DIMS


def check_layout(file: Path) -> None:
    """Walk a GGUF's header with every count and offset checked against the file's size, before
    the `gguf` reader (which trusts them) builds anything: an array that declares 2^40 entries or
    a tensor past the end of the file is refused in one line instead of filling the memory."""
    import gguf

    with (
        open(file, "rb") as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if file.stat().st_size
        else contextlib.nullcontext(b"") as data,
    ):
        size, pos = len(data), 0

        def take(fmt: str, what: str):
            nonlocal pos
            n = struct.calcsize("<" + fmt)
            if pos + n > size:
                raise CheckpointError(
                    f"'{file}' ends inside {what} (byte {pos} of {size}); the file is truncated or not a GGUF"
                )
            value = struct.unpack_from("<" + fmt, data, pos)[0]
            pos += n
            return value

        def skip(n: int, what: str) -> None:
            nonlocal pos
            if n > size - pos:
                raise CheckpointError(
                    f"'{file}': {what} declares {n:,} bytes, but {size - pos:,} remain; the file is "
                    "truncated or corrupt"
                )
            pos += n

        def value(kind: int, what: str, depth: int = 0) -> None:
            if kind in _SCALARS:
                take(_SCALARS[kind], what)
            elif kind == _STRING:
                skip(take("Q", what), what)
            elif kind == _ARRAY and depth == 0:
                item, count = take("I", what), take("Q", what)
                if count > size - pos:  # every entry takes a byte at least
                    raise CheckpointError(
                        f"'{file}': {what} declares {count:,} entries, more than the "
                        f"{size - pos:,} bytes that remain; the file is corrupt"
                    )
                if item in _SCALARS:
                    skip(count * struct.calcsize("<" + _SCALARS[item]), what)
                else:
                    for _ in range(count):
                        value(item, what, depth + 1)
            elif kind == _ARRAY:
                raise CheckpointError(
                    f"'{file}': {what} is an array of arrays, which llama.cpp never writes; the file is corrupt"
                )
            else:
                raise CheckpointError(
                    f"'{file}': {what} has value type {kind}, which GGUF does not define; the file is corrupt"
                )

        if take("4s", "the header") != b"GGUF":
            raise CheckpointError(f"'{file}' is not a GGUF (no GGUF magic); pass a llama.cpp .gguf file")
        version = take("I", "the header")
        if version not in (2, 3):
            raise CheckpointError(f"'{file}' is GGUF version {version}; versions 2 and 3 are read")
        tensors, kvs = take("Q", "the header"), take("Q", "the header")
        if tensors > size or kvs > size:
            raise CheckpointError(
                f"'{file}' declares {tensors:,} tensors and {kvs:,} metadata keys in {size:,} bytes; the file is corrupt"
            )
        alignment = 32
        for _ in range(kvs):
            key_at = pos
            skip(take("Q", "a metadata key"), "a metadata key")
            key = bytes(data[key_at + 8 : pos]).decode("utf-8", "replace")
            kind = take("I", f"metadata '{key}'")
            if key == "general.alignment" and kind == 4:
                alignment = struct.unpack_from("<I", data, pos)[0]
            value(kind, f"metadata '{key}'")
        if not alignment or alignment & (alignment - 1):
            raise CheckpointError(f"'{file}': general.alignment is {alignment}; expected a power of two")
        extents = []
        for _ in range(tensors):
            name_at = pos
            skip(take("Q", "a tensor's name"), "a tensor's name")
            name = bytes(data[name_at + 8 : pos]).decode("utf-8", "replace")
            dims = take("I", f"tensor '{name}'")
            if not 1 <= dims <= MAX_DIMS:
                raise CheckpointError(
                    f"'{file}': tensor '{name}' has {dims} dimensions; GGUF tensors have 1 to {MAX_DIMS}"
                )
            shape = [take("Q", f"tensor '{name}'") for _ in range(dims)]
            kind, offset = take("I", f"tensor '{name}'"), take("Q", f"tensor '{name}'")
            try:
                block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise CheckpointError(
                    f"'{file}': tensor '{name}' has type {kind}, which GGUF does not define"
                ) from None
            nbytes = math.prod(shape) // block * block_bytes
            if not 0 < nbytes <= size or shape[0] % block:
                raise CheckpointError(
                    f"'{file}': tensor '{name}' has shape {shape}, impossible for its type and the file's size"
                )
            extents.append((name, offset, nbytes))
        start = -(-pos // alignment) * alignment
        for name, offset, nbytes in extents:
            if start + offset + nbytes > size:
                raise CheckpointError(
                    f"'{file}': tensor '{name}' lies past the end of the file (bytes {start + offset:,} "
                    f"to {start + offset + nbytes:,} of {size:,}); the file is truncated or corrupt"
                )


def whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_blocks(arch: str, block_count: int, tensors, file: Path) -> None:
    """The blocks the tensor table holds must be 0 .. block_count - 1, before a model of that many
    layers is built (a file declaring a billion would otherwise fill the memory)."""
    blocks = {int(m.group(1)) for t in tensors if (m := re.match(r"blk\.(\d+)\.", t))}
    if len(blocks) != block_count or blocks != set(
        range(block_count)
    ):  # the count first: range(10**9) is no set to build
        raise CheckpointError(
            f"'{file}': {arch}.block_count is {block_count}, but the tensors hold {len(blocks)} "
            "block(s); the file is inconsistent"
        )


def check_metadata(arch: str, config: dict, tensors: dict, file: Path, config_keys: dict) -> None:
    """Every hyperparameter typed and in range, and the sizes the tensors have, before anything is
    built from them: one line naming the key, its value and what was expected."""
    keys = {ours: key for key, ours in config_keys.items()}
    check_hyperparameters(config, f"'{file}'", lambda ours: f"{arch}.{keys.get(ours, ours)}")
    if any(t.startswith("blk.") for t in tensors):  # else a vocabulary-only file (llama.cpp ships some)
        check_blocks(arch, config["num_hidden_layers"], tensors, file)
    dim = int(tensors["token_embd.weight"].shape[0])
    if config["hidden_size"] != dim:
        raise CheckpointError(
            f"'{file}': {arch}.embedding_length is {config['hidden_size']}, but token_embd is {dim} wide"
        )
    if "head_dim" not in config and config["hidden_size"] % config["num_attention_heads"]:
        raise CheckpointError(
            f"'{file}': {arch}.embedding_length {config['hidden_size']} is not a multiple of "
            f"{arch}.attention.head_count {config['num_attention_heads']}"
        )


def check_token_id(key: str, value, vocab_size: int, file: Path) -> int:
    """A special token's id: a whole number that is a row of token_embd."""
    if not whole(value) or not 0 <= value < vocab_size:
        raise CheckpointError(
            f"'{file}': {key} is {value!r}; expected a token id in [0, {vocab_size}), the rows of token_embd"
        )
    return value
