"""A seeded corpus of hostile inputs, and the child process that feeds each case to the tool.

Categories (each a generator of (name, bytes or text)):
- GGUF: truncations, byte flips in each region (header, metadata, tensor table, data), absurd and
  mistyped metadata, a tensor table that lies (offsets past the end, absurd shapes and types);
- chat templates: unbounded loops, string and list amplification, recursion, syntax errors;
- images: headers declaring huge sizes (PNG, JPEG, GIF, BMP), truncations and byte flips of real ones;
- export folders: malformed manifests and damaged programs.

Every case must end refused in one line (a GenAIError: the CLI prints `error: ...` and exits 2)
or accepted and correct, within a time and memory bound, never as an internal error, a hang or
a memory blow-up. `outcomes()` runs one category in a child process under those bounds and
returns each case's outcome; `python tests/fuzz/corpus.py [--table]` prints the table of
categories x outcomes for whichever `genai_pipeline` is importable (PYTHONPATH picks a checkout).
"""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
import zlib
from collections import Counter
from pathlib import Path

SEED = 20261206
CASE_SECONDS = 20  # one case, in the child; a real case takes well under a second
CHILD_MEMORY = 6 << 30  # address space of the child: a blow-up ends as a MemoryError, not a killed machine
OUTCOMES = ("accepted", "refused", "internal", "hang", "memory", "wrong")

# -- GGUF ----------------------------------------------------------------------------------------

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FORMATS = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q", F64: "d"}
F32_TENSOR, Q8_0_TENSOR = 0, 8


def _string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def _value(kind: int, value) -> bytes:
    if kind == STRING:
        return _string(value)
    if kind == ARRAY:
        item, items = value
        return struct.pack("<IQ", item, len(items)) + b"".join(_value(item, v) for v in items)
    return struct.pack("<" + _FORMATS[kind], value)


def gguf_bytes(metadata: dict, tensors: list[tuple[str, list[int], int, bytes]]) -> bytes:
    """A GGUF v3 file: metadata {key: (type, value)}, tensors (name, dims innermost first, type, data)."""
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    out += [_string(k) + struct.pack("<I", kind) + _value(kind, v) for k, (kind, v) in metadata.items()]
    offset, blobs = 0, []
    for name, dims, kind, data in tensors:
        out.append(
            _string(name)
            + struct.pack("<I", len(dims))
            + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", kind, offset)
        )
        padded = data + b"\0" * (-len(data) % 32)
        blobs.append(padded)
        offset += len(padded)
    header = b"".join(out)
    return header + b"\0" * (-len(header) % 32) + b"".join(blobs)


def _bytes_to_unicode() -> list[str]:
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


DIM, BLOCKS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64
VOCAB = [*_bytes_to_unicode(), "Ġt", "Ġth", "<|endoftext|>"]


def base_metadata() -> dict:
    return {
        "general.architecture": (STRING, "llama"),
        "llama.context_length": (U32, 64),
        "llama.embedding_length": (U32, DIM),
        "llama.block_count": (U32, BLOCKS),
        "llama.feed_forward_length": (U32, FFN),
        "llama.attention.head_count": (U32, HEADS),
        "llama.attention.head_count_kv": (U32, KV_HEADS),
        "llama.attention.layer_norm_rms_epsilon": (F32, 1e-5),
        "llama.rope.freq_base": (F32, 10000.0),
        "llama.rope.dimension_count": (U32, DIM // HEADS),
        "tokenizer.ggml.model": (STRING, "gpt2"),
        "tokenizer.ggml.pre": (STRING, "default"),
        "tokenizer.ggml.tokens": (ARRAY, (STRING, VOCAB)),
        "tokenizer.ggml.token_type": (ARRAY, (I32, [1] * (len(VOCAB) - 1) + [3])),
        "tokenizer.ggml.merges": (ARRAY, (STRING, ["Ġ t", "Ġt h"])),
        "tokenizer.ggml.bos_token_id": (U32, len(VOCAB) - 1),
        "tokenizer.ggml.eos_token_id": (U32, len(VOCAB) - 1),
        "tokenizer.chat_template": (STRING, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"),
    }


def base_tensors(rng: random.Random) -> list[tuple[str, list[int], int, bytes]]:
    def weights(*shape) -> bytes:  # numpy order [rows, cols]; GGUF lists dims innermost first
        n = 1
        for s in shape:
            n *= s
        return struct.pack(f"<{n}f", *(rng.gauss(0, 0.05) for _ in range(n)))

    def ones(n) -> bytes:
        return struct.pack(f"<{n}f", *([1.0] * n))

    head = DIM // HEADS
    tensors = [("token_embd.weight", [DIM, len(VOCAB)], F32_TENSOR, weights(len(VOCAB), DIM))]
    for b in range(BLOCKS):
        tensors += [
            (f"blk.{b}.attn_norm.weight", [DIM], F32_TENSOR, ones(DIM)),
            (f"blk.{b}.attn_q.weight", [DIM, DIM], F32_TENSOR, weights(DIM, DIM)),
            (f"blk.{b}.attn_k.weight", [DIM, KV_HEADS * head], F32_TENSOR, weights(KV_HEADS * head, DIM)),
            (f"blk.{b}.attn_v.weight", [DIM, KV_HEADS * head], F32_TENSOR, weights(KV_HEADS * head, DIM)),
            (f"blk.{b}.attn_output.weight", [DIM, DIM], F32_TENSOR, weights(DIM, DIM)),
            (f"blk.{b}.ffn_norm.weight", [DIM], F32_TENSOR, ones(DIM)),
            (f"blk.{b}.ffn_gate.weight", [DIM, FFN], F32_TENSOR, weights(FFN, DIM)),
            (f"blk.{b}.ffn_down.weight", [FFN, DIM], F32_TENSOR, weights(DIM, FFN)),
            (f"blk.{b}.ffn_up.weight", [DIM, FFN], F32_TENSOR, weights(FFN, DIM)),
        ]
    return tensors + [("output_norm.weight", [DIM], F32_TENSOR, ones(DIM))]


def base_gguf() -> bytes:
    return gguf_bytes(base_metadata(), base_tensors(random.Random(SEED)))


def _regions(data: bytes) -> dict[str, tuple[int, int]]:
    """Byte ranges of the base file: header, metadata, tensor table, data."""
    metadata = b"".join(
        _string(k) + struct.pack("<I", kind) + _value(kind, v) for k, (kind, v) in base_metadata().items()
    )
    tensors = base_tensors(random.Random(SEED))
    table = sum(8 + len(n) + 4 + 8 * len(d) + 12 for n, d, _, _ in tensors)
    data_start = 24 + len(metadata) + table
    data_start += -data_start % 32
    return {
        "header": (0, 24),
        "metadata": (24, 24 + len(metadata)),
        "tensor table": (24 + len(metadata), 24 + len(metadata) + table),
        "data": (data_start, len(data)),
    }


# Metadata values a hostile or broken file may hold: (key, type, value)
ABSURD_METADATA = [
    ("llama.block_count", U64, 10**9),
    ("llama.block_count", U64, 2**64 - 1),
    ("llama.block_count", U32, 0),
    ("llama.block_count", F32, 2.5),
    ("llama.block_count", STRING, "two"),
    ("llama.block_count", U32, 3),
    ("llama.embedding_length", U32, 0),
    ("llama.embedding_length", U64, 2**62),
    ("llama.embedding_length", I32, -32),
    ("llama.embedding_length", U32, 33),
    ("llama.attention.head_count", U32, 0),
    ("llama.attention.head_count", U32, 3),
    ("llama.attention.head_count", U32, 10**6),
    ("llama.attention.head_count_kv", U32, 0),
    ("llama.attention.head_count_kv", U32, 3),
    ("llama.feed_forward_length", U32, 0),
    ("llama.feed_forward_length", U32, 65),
    ("llama.feed_forward_length", U64, 2**40),
    ("llama.context_length", U32, 0),
    ("llama.context_length", I32, -1),
    ("llama.context_length", STRING, "long"),
    ("llama.rope.dimension_count", STRING, "sixteen"),
    ("llama.rope.dimension_count", U32, 0),
    ("llama.rope.dimension_count", U32, 7),
    ("llama.rope.dimension_count", U32, 4096),
    ("llama.rope.freq_base", F32, float("nan")),
    ("llama.rope.freq_base", F32, float("inf")),
    ("llama.rope.freq_base", F32, -1.0),
    ("llama.attention.layer_norm_rms_epsilon", F32, float("nan")),
    ("llama.attention.layer_norm_rms_epsilon", F32, 0.0),
    ("llama.attention.layer_norm_rms_epsilon", STRING, "tiny"),
    ("tokenizer.ggml.bos_token_id", U32, 10**6),
    ("tokenizer.ggml.eos_token_id", U32, len(VOCAB)),
    ("tokenizer.ggml.eos_token_id", STRING, "</s>"),
    ("tokenizer.ggml.bos_token_id", F32, float("nan")),
    ("tokenizer.ggml.eos_token_id", ARRAY, (U32, [299, 298])),
    ("tokenizer.ggml.bos_token_id", I32, -1),
    ("general.architecture", ARRAY, (STRING, ["llama"])),
    ("general.architecture", STRING, "mamba"),
    ("general.architecture", U32, 7),
    ("tokenizer.ggml.model", STRING, "bert"),
    ("tokenizer.ggml.model", U32, 1),
    ("tokenizer.ggml.tokens", ARRAY, (U32, [1, 2])),
    ("tokenizer.ggml.tokens", ARRAY, (STRING, VOCAB[:10])),
    ("tokenizer.ggml.tokens", STRING, "abc"),
    ("tokenizer.ggml.token_type", ARRAY, (I32, [1])),
    ("tokenizer.ggml.merges", ARRAY, (STRING, ["a"])),
    ("tokenizer.ggml.merges", ARRAY, (U32, [1])),
    ("tokenizer.ggml.add_bos_token", STRING, "no"),
    ("tokenizer.ggml.unknown_token_id", U32, 10**6),
    ("tokenizer.ggml.padding_token_id", U32, 2**31),
    (
        "tokenizer.chat_template",
        STRING,
        "{% for x in range(100000) %}{% for y in range(100000) %}{% endfor %}{% endfor %}",
    ),
    ("tokenizer.chat_template", STRING, "{{ 'a' * 10**10 }}"),
    ("tokenizer.chat_template", STRING, "{% if %}"),
    ("tokenizer.chat_template", U32, 5),
    ("general.alignment", U32, 3),
    ("general.alignment", U32, 0),
]


def gguf_cases() -> dict[str, list[tuple[str, bytes]]]:
    rng = random.Random(SEED)
    base = base_gguf()
    regions = _regions(base)
    cases: dict[str, list[tuple[str, bytes]]] = {
        "gguf: truncations": [],
        "gguf: absurd metadata": [],
        "gguf: lying tensor table": [],
    }
    for cut in sorted({0, 3, 4, 8, 16, 23, 24, *(rng.randrange(24, len(base)) for _ in range(30))}):
        cases["gguf: truncations"].append((f"cut at {cut}", base[:cut]))
    for region, (lo, hi) in regions.items():
        flips = cases.setdefault(f"gguf: byte flips in the {region}", [])
        for n in range(24 if region != "data" else 16):
            data = bytearray(base)
            for _ in range(rng.choice((1, 1, 2, 4))):
                at = rng.randrange(lo, hi)
                data[at] = rng.choice((data[at] ^ (1 << rng.randrange(8)), 0xFF, 0x00, 0x7F))
            flips.append((f"{region} #{n}", bytes(data)))
    data_lo = regions["data"][0]
    for n, value in enumerate((float("nan"), float("inf"), float("-inf"))):
        data = bytearray(base)
        at = data_lo + 4 * rng.randrange(0, 200)
        data[at : at + 4] = struct.pack("<f", value)
        cases["gguf: byte flips in the data"].append((f"a weight set to {value}", bytes(data)))
    for key, kind, value in ABSURD_METADATA:
        metadata = base_metadata()
        metadata[key] = (kind, value)
        cases["gguf: absurd metadata"].append(
            (f"{key} = {value!r:.40}", gguf_bytes(metadata, base_tensors(random.Random(SEED))))
        )
    cases["gguf: absurd metadata"].append(("an array declaring 2^40 entries", _lying_array(base)))
    tensors = base_tensors(random.Random(SEED))
    lies = [
        ("offset past the end", lambda t: [(t[0][0], t[0][1], t[0][2], t[0][3])] + t[1:], "offset"),
        ("a tensor of 2^62 values", lambda t: [(t[0][0], [2**31, 2**31], t[0][2], t[0][3])] + t[1:], None),
        ("5 dimensions", lambda t: [(t[0][0], [DIM, len(VOCAB), 1, 1, 1], t[0][2], t[0][3])] + t[1:], None),
        ("a dimension of 0", lambda t: [(t[0][0], [DIM, 0], t[0][2], t[0][3])] + t[1:], None),
        ("an undefined type", lambda t: [(t[0][0], t[0][1], 99, t[0][3])] + t[1:], None),
        (
            "a quantized type with a shape that is not whole blocks",
            lambda t: [(t[0][0], [33, len(VOCAB)], Q8_0_TENSOR, t[0][3])] + t[1:],
            None,
        ),
        ("a block missing", lambda t: [x for x in t if not x[0].startswith("blk.1.")], None),
        ("a block more", lambda t: t + [("blk.2.attn_norm.weight", [DIM], F32_TENSOR, t[1][3])], None),
        ("a tensor duplicated", lambda t: t + [t[1]], None),
        (
            "a tensor of another shape",
            lambda t: [t[0], (t[1][0], [DIM + 1], F32_TENSOR, t[1][3] + b"\0" * 4)] + t[2:],
            None,
        ),
        ("an unknown tensor", lambda t: t + [("blk.0.mystery.weight", [DIM], F32_TENSOR, t[1][3])], None),
        ("token_embd missing", lambda t: t[1:], None),
        (
            "embedding rows fewer than the vocabulary",
            lambda t: [(t[0][0], [DIM, 100], F32_TENSOR, t[0][3][: 100 * DIM * 4])] + t[1:],
            None,
        ),
        ("a name of 2^40 bytes", None, "name"),
    ]
    for name, change, hack in lies:
        if change is not None:
            data = gguf_bytes(base_metadata(), change(list(tensors)))
            if hack == "offset":
                data = _patched_first_offset(data, 1 << 40)
        else:
            data = _patched_first_name_length(base, 1 << 40)
        cases["gguf: lying tensor table"].append((name, data))
    return cases


def _lying_array(base: bytes) -> bytes:
    """The token list's declared count set to 2^40 (its entries unchanged)."""
    key = _string("tokenizer.ggml.tokens") + struct.pack("<I", ARRAY) + struct.pack("<I", STRING)
    at = base.index(key) + len(key)
    return base[:at] + struct.pack("<Q", 1 << 40) + base[at + 8 :]


def _table_start(data: bytes) -> int:
    _, _, tensors, kvs = struct.unpack_from("<4sIQQ", data, 0)
    pos = 24
    for _ in range(kvs):
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        (kind,) = struct.unpack_from("<I", data, pos)
        pos += 4
        pos = _skip_value(data, pos, kind)
    return pos


def _skip_value(data: bytes, pos: int, kind: int) -> int:
    if kind == STRING:
        return pos + 8 + struct.unpack_from("<Q", data, pos)[0]
    if kind == ARRAY:
        item, count = struct.unpack_from("<IQ", data, pos)
        pos += 12
        for _ in range(count):
            pos = _skip_value(data, pos, item)
        return pos
    return pos + struct.calcsize("<" + _FORMATS[kind])


def _patched_first_offset(data: bytes, offset: int) -> bytes:
    pos = _table_start(data)
    (n,) = struct.unpack_from("<Q", data, pos)
    pos += 8 + n
    (dims,) = struct.unpack_from("<I", data, pos)
    pos += 4 + 8 * dims + 4
    return data[:pos] + struct.pack("<Q", offset) + data[pos + 8 :]


def _patched_first_name_length(data: bytes, length: int) -> bytes:
    pos = _table_start(data)
    return data[:pos] + struct.pack("<Q", length) + data[pos + 8 :]


# -- chat templates ------------------------------------------------------------------------------

HOSTILE_TEMPLATES = {
    "nested loops": "{% for x in range(100000) %}{% for y in range(100000) %}{% endfor %}{% endfor %}",
    "string repetition": "{{ 'a' * 10**10 }}",
    "list repetition": "{% set l = [0] * 10**9 %}",
    "doubling concatenation": "{% set ns = namespace(s='ab') %}{% for i in range(200) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling addition": "{% set ns = namespace(s='ab') %}{% for i in range(200) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "list doubling": "{% set ns = namespace(l=[1]) %}{% for i in range(200) %}{% set ns.l = ns.l + ns.l %}{% endfor %}",
    "ljust": "{{ 'a'.ljust(10**10) }}",
    "center filter": "{{ 'a' | center(10**10) }}",
    "indent filter": "{{ 'a\nb' | indent(10**10) }}",
    "format filter": "{{ '%*d' | format(10**10, 1) }}",
    "replace amplification": "{% set s = 'a' * 20000 %}{{ s.replace('a', s) }}",
    "replace filter amplification": "{% set s = 'a' * 20000 %}{{ s | replace('a', s) }}",
    "join amplification": "{% set s = 'a' * 20000 %}{{ s | join(s) }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "deep nesting": "{% if true %}" * 3000 + "x" + "{% endif %}" * 3000,
    "huge power": "{{ 2 ** 2 ** 2 ** 2 ** 2 ** 2 }}",
    "attribute escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "syntax error": "{% for m in messages %}",
    "undefined call": "{{ nothing() }}",
    "raise_exception": "{{ raise_exception('no') }}",
    "range past the sandbox": "{% for x in range(10**9) %}{% endfor %}",
    "loop over a huge string": "{% for c in 'a' * 10**7 %}{% endfor %}",
    "division by zero": "{{ 1 / 0 }}",
}


def template_cases() -> dict[str, list[tuple[str, str]]]:
    rng = random.Random(SEED)
    real = base_metadata()["tokenizer.chat_template"][1]
    smollm = (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
        "You are a helpful AI assistant<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    mutations = []
    for n in range(40):
        source = list(rng.choice((real, smollm)))
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(source))
            source[at] = rng.choice(("{", "}", "%", "(", ")", "'", "*", "~", "[", "]", "|", "9", " ", ""))
        mutations.append((f"mutated #{n}", "".join(source)))
    return {"templates: hostile": list(HOSTILE_TEMPLATES.items()), "templates: mutated": mutations}


# -- images --------------------------------------------------------------------------------------


def _png(width: int, height: int, body: bytes = b"\0" * 16) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(body))
        + chunk(b"IEND", b"")
    )


def _jpeg_declaring(width: int, height: int) -> bytes:
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + b"\x01\x11\x00\x02\x11\x00\x03\x11\x00"
    return b"\xff\xd8" + sof + b"\xff\xd9"


def _real_image(kind: str) -> bytes:
    import io

    from PIL import Image

    rng = random.Random(SEED)
    image = Image.frombytes("RGB", (24, 16), bytes(rng.randrange(256) for _ in range(24 * 16 * 3)))
    buffer = io.BytesIO()
    image.save(buffer, format=kind)
    return buffer.getvalue()


def image_cases() -> dict[str, list[tuple[str, bytes]]]:
    rng = random.Random(SEED)
    bombs = [
        ("png 50000 x 50000", _png(50000, 50000)),
        ("png 2147483647 x 1", _png(2147483647, 1)),
        ("png 10000 x 9000", _png(10000, 9000)),
        ("png 0 x 0", _png(0, 0)),
        ("jpeg 65500 x 65500", _jpeg_declaring(65500, 65500)),
        ("gif 65535 x 65535", b"GIF89a" + struct.pack("<HH", 65535, 65535) + b"\x00\x00\x00;"),
        (
            "bmp 100000 x 100000",
            b"BM"
            + struct.pack("<IHHI", 54, 0, 0, 54)
            + struct.pack("<IiiHHIIiiII", 40, 100000, 100000, 1, 24, 0, 0, 0, 0, 0, 0),
        ),
        ("empty file", b""),
        ("text", b"not an image at all\n"),
    ]
    damaged = []
    for kind in ("PNG", "JPEG", "GIF", "BMP", "WEBP"):
        real = _real_image(kind)
        damaged.append((f"{kind.lower()} intact", real))
        for n in range(6):
            data = bytearray(real)
            for _ in range(rng.choice((1, 3))):
                at = rng.randrange(len(data))
                data[at] ^= 1 << rng.randrange(8)
            damaged.append((f"{kind.lower()} flipped #{n}", bytes(data)))
        damaged.append((f"{kind.lower()} truncated", real[: len(real) // 2]))
    return {"images: declared sizes": bombs, "images: damaged": damaged}


# -- export folders ------------------------------------------------------------------------------


def manifest_cases(manifest: dict) -> list[tuple[str, object]]:
    """Manifests a reader may meet: (name, the JSON value written as manifest.json)."""

    def without(key):
        return {k: v for k, v in manifest.items() if k != key}

    def with_(key, value):
        return {**manifest, key: value}

    artifact = next(iter(manifest["artifacts"]))
    return [
        ("a list", [1, 2]),
        ("null", None),
        ("a string", "manifest"),
        ("an empty object", {}),
        ("no artifacts", without("artifacts")),
        ("config null", with_("config", None)),
        ("config a list", with_("config", [])),
        ("max_seq_len a string", with_("max_seq_len", "512")),
        ("max_seq_len 0", with_("max_seq_len", 0)),
        ("max_seq_len true", with_("max_seq_len", True)),
        ("mode unknown", with_("mode", "turbo")),
        ("artifacts a list", with_("artifacts", [])),
        ("artifact not an object", with_("artifacts", {artifact: 3})),
        (
            "artifact file outside the folder",
            with_("artifacts", {artifact: {**manifest["artifacts"][artifact], "file": "../x.pte"}}),
        ),
        (
            "artifact file missing",
            with_("artifacts", {artifact: {**manifest["artifacts"][artifact], "file": "gone.pte"}}),
        ),
        ("files null", with_("files", None)),
        ("bos id a string", with_("bos_id", "<s>")),
        ("eos ids null", with_("eos_ids", None)),
        ("vocab size 0", with_("config", {**manifest["config"], "vocab_size": 0})),
        (
            "config of another model",
            with_("config", {**manifest["config"], "n_layers": manifest["config"]["n_layers"] + 1}),
        ),
        ("max_seq_len of another export", with_("max_seq_len", manifest["max_seq_len"] * 2)),
    ]


# -- running the cases ---------------------------------------------------------------------------

_CHILD = r"""
import json, resource, signal, sys, traceback
from pathlib import Path
resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))
kind, folder, start = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
from genai_pipeline.errors import GenAIError
sys.path.insert(0, {here!r})
import corpus
run = corpus.CHECKS[kind]

def alarm(*_):
    raise TimeoutError
signal.signal(signal.SIGALRM, alarm)
for case in sorted(folder.iterdir(), key=lambda p: int(p.name.split("-")[0]))[start:]:
    signal.alarm({seconds})
    try:
        wrong = run(case)
        outcome, message = ("wrong", wrong) if wrong else ("accepted", "")
    except GenAIError as e:
        outcome, message = ("refused" if len(str(e).splitlines()) == 1 else "internal"), str(e)
    except TimeoutError:
        outcome, message = "hang", ""
    except MemoryError:
        outcome, message = "memory", ""
    except BaseException as e:
        outcome, message = "internal", f"{{type(e).__name__}}: {{e}}"[:300]
    finally:
        signal.alarm(0)
    print(json.dumps({{"case": case.name, "outcome": outcome, "message": message[:300]}}), flush=True)
"""


def check_gguf(path: Path) -> str | None:
    """Load a GGUF as `genai export` does before any export work; what is wrong with an accepted one."""
    import math

    from genai_pipeline.checkpoints import infer_checkpoint_spec, load_decoder, metadata_folder
    from genai_pipeline.checkpoints.special_tokens import read_special_tokens
    from genai_pipeline.tokenizer import Tokenizer, find_tokenizer_file

    spec, _ = infer_checkpoint_spec(path)
    folder = metadata_folder(path)
    tokenizer = Tokenizer.from_folder(find_tokenizer_file(folder).parent, bos_id=spec.bos_id)
    tokenizer.encode("the quick brown fox")
    read_special_tokens(folder, spec.chat_template, spec.bos_id, spec.eos_ids)
    decoder = load_decoder(spec, path, 16)
    vocab = decoder.config.vocab_size
    if not all(math.isfinite(float(p.abs().max())) for p in decoder.parameters()):
        return "non-finite weights accepted"
    if any(not 0 <= i < vocab for i in [spec.bos_id, *spec.eos_ids] if i is not None):
        return f"special ids {spec.bos_id} / {spec.eos_ids} outside the vocabulary of {vocab}"
    return None


def check_template(path: Path) -> str | None:
    from genai_pipeline.chat_template import render_chat
    from genai_pipeline.messages import Message

    render_chat(
        (Message("system", "Be brief."), Message("user", "Hello?")), path.read_text(), add_generation_prompt=True
    )
    return None


def check_image(path: Path) -> str | None:
    from genai_pipeline.image_files import read_image

    pixels = read_image(path)
    return None if pixels.ndim == 3 and pixels.shape[2] == 3 else f"an image of shape {pixels.shape}"


CHECKS = {"gguf": check_gguf, "templates": check_template, "images": check_image}


def all_cases() -> dict[str, list[tuple[str, bytes | str]]]:
    return {**gguf_cases(), **template_cases(), **image_cases()}


def outcomes(
    cases: dict[str, list[tuple[str, bytes | str]]], folder: Path, timeout: float = 600
) -> dict[str, list[dict]]:
    """Each case fed to the tool, one child process per kind of input (gguf, templates, images),
    bounded in time (per case) and memory; {category: [{case, outcome, message, category}]}."""
    rows: dict[str, list[dict]] = {category: [] for category in cases}
    for kind, suffix in (("gguf", ".gguf"), ("templates", ".jinja"), ("images", ".png")):
        mine = [(c, n, content) for c, items in cases.items() if c.split(":")[0] == kind for n, content in items]
        if not mine:
            continue
        where = folder / kind
        where.mkdir(parents=True, exist_ok=True)
        files = {}
        for i, (category, name, content) in enumerate(mine):
            path = where / f"{i}-{''.join(c if c.isalnum() else '_' for c in name)[:40]}{suffix}"
            path.write_bytes(content.encode() if isinstance(content, str) else content)
            files[path.name] = (category, name)
        child = _CHILD.format(memory=CHILD_MEMORY, here=str(Path(__file__).parent), seconds=CASE_SECONDS)
        done = 0
        while done < len(mine):
            result = subprocess.run(
                [sys.executable, "-c", child, kind, str(where), str(done)],
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            seen = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
            for row in seen:
                category, name = files[row["case"]]
                rows[category].append({**row, "case": name})
            done += len(seen)
            if done < len(mine):  # the child died on this case (killed for its memory, say): go on after it
                category, name, _ = mine[done]
                rows[category].append({"case": name, "outcome": "memory", "message": result.stderr[-300:]})
                done += 1
    return rows


def table(results: dict[str, list[dict]]) -> str:
    lines = [f"| category | cases | {' | '.join(OUTCOMES)} |", "|---|---|" + "---|" * len(OUTCOMES)]
    for category, rows in results.items():
        counts = Counter(r["outcome"] for r in rows)
        lines.append(f"| {category} | {len(rows)} | " + " | ".join(str(counts.get(o, 0)) for o in OUTCOMES) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    import tempfile
    import time

    results, seconds = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        cases = all_cases()
        for kind in ("gguf", "templates", "images"):
            started = time.monotonic()
            results.update(outcomes({c: v for c, v in cases.items() if c.startswith(kind)}, Path(scratch) / kind))
            seconds[kind] = round(time.monotonic() - started, 1)
    for category, rows in results.items():
        for row in rows:
            if row["outcome"] not in ("accepted", "refused") or "--verbose" in sys.argv:
                print(f"  {category}: {row['case']}: {row['outcome']} {row['message'][:160]}", file=sys.stderr)
    print(table(results))
    print(
        f"{sum(map(len, results.values()))} cases; seconds by kind (one child process each, its imports included): {seconds}"
    )
