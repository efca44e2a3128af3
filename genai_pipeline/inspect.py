"""A look inside a .pte: methods and their I/O, delegates, shared weights and buffers, metadata."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from genai_pipeline.errors import ProgramError
from genai_pipeline.runtime.program import check_pte_file
from genai_pipeline.upstream.executorch_pte_reader import read_program


def _tensor_desc(value) -> dict | None:
    t = value.val
    if type(t).__name__ != "Tensor":
        return {"type": type(t).__name__}
    desc = {"shape": list(t.sizes), "dtype": t.scalar_type.name.lower()}
    if int(t.shape_dynamism) != 0:  # not STATIC: `shape` is the bound (a dynamic-length method)
        desc["dynamic"] = True
    return desc


def _scalar(value):
    t = value.val
    for attr in ("int_val", "bool_val", "double_val", "string_val"):
        if hasattr(t, attr):
            return getattr(t, attr)
    return None


def constant_sizes(program) -> dict[int, int]:
    """Bytes of each constant tensor (padding included), by its buffer index."""
    if not program.constant_segment.offsets:  # inline constants (no segments)
        return {i: len(b.storage) for i, b in enumerate(program.constant_buffer)}
    offsets = list(program.constant_segment.offsets)
    ends = offsets[1:] + [program.segments[program.constant_segment.segment_index].size]
    return {i: end - start for i, (start, end) in enumerate(zip(offsets, ends))}


def _weights(program, segment, const_users: dict, const_sizes: dict, named_sizes: dict) -> dict:
    """Bytes of weights the file stores (constant segment and named data, each range of the file
    once), named data that is a range of the constant segment (a tied embedding's table, which the
    delegated LM head reads too), and bytes stored twice: named data with the same bytes as a
    constant tensor in a range of its own."""
    index = program.constant_segment.segment_index
    offsets = program.constant_segment.offsets
    start = program.segments[index].offset if offsets else 0
    ranges = [(offsets[i], const_sizes[i]) for i in const_users]  # in the constant segment
    inside, twice = 0, 0
    for entry in program.named_data or []:
        s = program.segments[entry.segment_index]
        if any(start + o <= s.offset and s.offset + s.size <= start + o + n for o, n in ranges):
            inside += s.size
            continue
        # Candidates by size (a constant's size includes its padding), then by content.
        same_size = [o for o, n in ranges if s.size <= n < s.size + 64]
        if same_size:
            data = segment(entry.segment_index)
            twice += s.size if any(segment(index, o, s.size) == data for o in same_size) else 0
    stored = sum(const_sizes[i] for i in const_users) + sum(named_sizes.values()) - inside
    return {"bytes": stored, "named_data_in_constant_segment_bytes": inside, "stored_twice_bytes": twice}


def inspect_program(path: Path) -> dict:
    path = check_pte_file(path)
    from executorch.exir.schema import DataLocation

    try:
        program, segment = read_program(path)
    except ProgramError:  # another ExecuTorch (upstream/executorch_pte_reader.py)
        raise
    except Exception as e:  # any parse failure of a damaged flatbuffer
        raise ProgramError(
            f"'{path}' cannot be parsed as an ExecuTorch program ({type(e).__name__}); it is corrupt or truncated, re-export it"
        ) from None
    named_sizes = {entry.key: program.segments[entry.segment_index].size for entry in program.named_data or []}

    methods, metadata = {}, {}
    const_users = defaultdict(set)  # constant-segment buffer index -> methods using it
    named_users = defaultdict(set)  # named-data key -> methods whose delegates reference it
    placements = defaultdict(dict)  # mutable buffer name -> {method: (arena, offset)}
    payloads = {}  # (inline?, index) -> the delegate payload and the methods referencing it
    for plan in program.execution_plan:
        if not plan.inputs and all(_scalar(plan.values[i]) is not None for i in plan.outputs):
            out = [_scalar(plan.values[i]) for i in plan.outputs]
            metadata[plan.name] = out[0] if len(out) == 1 else out
            continue
        delegates = []
        for d in plan.delegates:
            inline = d.processed.location == DataLocation.INLINE
            blob = program.backend_delegate_data[d.processed.index].data if inline else segment(d.processed.index)
            delegates.append({"backend": d.id, "bytes": len(blob)})
            payload = payloads.setdefault(
                (inline, d.processed.index), {"backend": d.id, "bytes": len(blob), "methods": []}
            )
            if plan.name not in payload["methods"]:
                payload["methods"].append(plan.name)
            qnn_spec = next((bytes(c.value) for c in d.compile_specs if c.key == "qnn_compile_spec"), None)
            if qnn_spec is not None and "qnn" not in payload:
                payload["qnn"] = _qnn_spec(qnn_spec)
            for key in named_sizes:
                if key.encode() in blob:
                    named_users[key].add(plan.name)
        for v in plan.values:
            t = v.val
            if type(t).__name__ != "Tensor":
                continue
            if t.allocation_info is None and t.data_buffer_idx > 0:
                const_users[t.data_buffer_idx].add(plan.name)
            info = t.extra_tensor_info
            if info is not None and info.fully_qualified_name and t.allocation_info is not None:
                a = t.allocation_info
                placements[info.fully_qualified_name][plan.name] = (
                    a.memory_id,
                    a.memory_offset_low + (a.memory_offset_high << 32),
                )
        by_backend = defaultdict(int)
        for d in delegates:
            by_backend[d["backend"]] += 1
        methods[plan.name] = {
            "inputs": [_tensor_desc(plan.values[i]) for i in plan.inputs],
            "outputs": [_tensor_desc(plan.values[i]) for i in plan.outputs],
            "delegates": dict(by_backend),
            "delegate_bytes": sum(d["bytes"] for d in delegates),
            "operators": len(plan.operators),
            "planned_arena_bytes": list(plan.non_const_buffer_sizes[1:]),
        }
    compute = set(methods)

    def shared(users: set) -> bool:
        return len(compute) > 1 and users == compute

    const_sizes = constant_sizes(program)
    mutable = {
        name: {
            "placement": {m: list(p) for m, p in where.items()},
            "shared": len(where) > 1 and len(set(where.values())) == 1,
        }
        for name, where in placements.items()
    }
    return {
        "file": str(path),
        "file_bytes": path.stat().st_size,
        "methods": methods,
        "metadata": metadata,
        "constant_segment": {
            "buffers": len(const_users),
            "bytes": sum(const_sizes[i] for i in const_users),
            "shared_bytes": sum(const_sizes[i] for i, u in const_users.items() if shared(u)),
        },
        "named_data": {
            "entries": len(named_sizes),
            "bytes": sum(named_sizes.values()),
            "shared_bytes": sum(named_sizes[k] for k, u in named_users.items() if shared(u)),
        },
        "weights": _weights(program, segment, const_users, const_sizes, named_sizes),
        "mutable_buffers": mutable,
        # Each delegate payload once, with the methods that reference it (a QNN context binary
        # holding several graphs is referenced by each of them) and a QNN compile spec decoded.
        "delegate_payloads": list(payloads.values()),
        "stock_runners": stock_runners(methods, metadata, mutable),
    }


# What ExecuTorch's LLM runners call, as their C++ sources read at the pinned version
# (extension/llm/runner: llm_runner_helper.cpp, text_prefiller.cpp, text_decoder_runner.cpp,
# multimodal_prefiller.cpp): every runner reads `get_max_seq_len`; TextLLMRunner prefills through
# `forward`, else `prefill`, a prompt longer than get_max_seq_len in chunks of it, in one call each
# when enable_dynamic_shape, else token by token; it decodes through `decode`, else the same method,
# and gives each method arenas of its own (a KV cache shared by two methods is then two caches).
# MultimodalRunner sends each text, image or preprocessed-audio input through `token_embedding` /
# `vision_encoder` / `audio_encoder` (float32 [batch, n_bins, n_frames]), then `text_decoder`, whole.
STOCK_RUNNERS = ("TextLLMRunner", "MultimodalRunner")


def _input_problem(method: dict, name: str, kinds: tuple, tokens: int) -> str | None:
    """Why `method` cannot be called with the inputs a runner builds (`kinds`: each input's dtypes
    and rank; the first takes 1 to `tokens` rows in dim 1), or None."""
    inputs = method["inputs"]
    if len(inputs) != len(kinds):
        return f"`{name}` takes {len(inputs)} inputs, not {len(kinds)}"
    for t, (dtypes, rank) in zip(inputs, kinds):
        if t.get("dtype") not in dtypes or len(t.get("shape", ())) != rank:
            return f"`{name}` takes {t.get('dtype', t.get('type'))}{t.get('shape', '')}, not {'/'.join(dtypes)} of rank {rank}"
    bound, dynamic = inputs[0]["shape"][1], inputs[0].get("dynamic", False)
    if not (bound == tokens == 1 or dynamic and bound >= tokens):
        sent = "1 row" if tokens == 1 else f"1 to {tokens} rows"
        return f"`{name}` takes {'1 to ' if dynamic else ''}{bound} rows a call; the runner sends {sent}"
    if len(method["outputs"]) != 1:
        return f"`{name}` returns {len(method['outputs'])} values, not the logits alone"
    return None


def _text_llm_runner(methods: dict, metadata: dict, buffers: dict) -> str | None:
    prefill = next((m for m in ("forward", "prefill") if m in methods), None)
    if prefill is None:
        return "no `forward` or `prefill` method"
    if not metadata.get("use_kv_cache", True):
        return "use_kv_cache is false"
    chunk = metadata["get_max_seq_len"] if metadata.get("enable_dynamic_shape", False) else 1
    tokens = (("long",), 2), (("long",), 1)  # token ids [1, T], the start position [1]
    decode = "decode" if "decode" in methods else prefill
    if decode != prefill and any({prefill, decode} <= set(b["placement"]) for b in buffers.values()):
        return f"`{prefill}` and `{decode}` share a KV cache, which the runner gives each method one of"
    return _input_problem(methods[prefill], prefill, tokens, chunk) or _input_problem(
        methods[decode], decode, tokens, 1
    )


def _multimodal_runner(methods: dict, metadata: dict) -> str | None:
    for name in ("token_embedding", "text_decoder"):
        if name not in methods:
            return f"no `{name}` method"
    longest = metadata.get("get_max_context_len", metadata["get_max_seq_len"])
    problem = _input_problem(methods["token_embedding"], "token_embedding", ((("long",), 2),), longest)
    embeddings = (("float", "bfloat16", "half"), 3), (("long",), 1)  # [1, T, D], the start position [1]
    problem = problem or _input_problem(methods["text_decoder"], "text_decoder", embeddings, longest)
    image = methods.get("vision_encoder")
    if (
        problem is None
        and image is not None
        and not (len(image["inputs"]) == 1 and image["inputs"][0].get("dtype") in ("byte", "float", "bfloat16"))
    ):
        return "`vision_encoder` does not take one uint8 or float image"
    audio = methods.get("audio_encoder")
    if (
        problem is None
        and audio is not None
        and not (
            len(audio["inputs"]) == 1
            and audio["inputs"][0].get("dtype") == "float"
            and len(audio["inputs"][0].get("shape", ())) == 3
        )
    ):
        return "`audio_encoder` does not take one float32 [batch, n_bins, n_frames] spectrogram"
    return problem


def stock_runners(methods: dict, metadata: dict, buffers: dict) -> dict[str, str | None]:
    """Each of ExecuTorch's LLM runners -> None where it runs this program, else why not
    (`buffers`: the mutable buffers, each with the methods it is placed in)."""
    if "get_max_seq_len" not in metadata:
        return dict.fromkeys(STOCK_RUNNERS, "no get_max_seq_len method")
    return {
        "TextLLMRunner": _text_llm_runner(methods, metadata, buffers),
        "MultimodalRunner": _multimodal_runner(methods, metadata),
    }


def _qnn_spec(spec: bytes) -> dict:
    from genai_pipeline.targets import qnn_specs

    try:
        return qnn_specs.describe(spec)
    except Exception as e:  # a spec of another ExecuTorch version's schema
        return {"error": f"cannot decode ({type(e).__name__})"}


def format_report(r: dict) -> str:
    mib = 1 << 20
    lines = [f"{r['file']}  {r['file_bytes'] / mib:.2f} MiB"]
    for name, m in r["methods"].items():
        io = lambda ts: ", ".join(
            f"{t.get('dtype', t.get('type'))}{t.get('shape', '')}{' at most' if t.get('dynamic') else ''}"  # noqa: E731
            for t in ts
        )
        delegates = ", ".join(f"{n}x {b}" for b, n in m["delegates"].items()) or "none"
        lines.append(f"method {name}: ({io(m['inputs'])}) -> ({io(m['outputs'])})")
        lines.append(
            f"    delegates: {delegates} ({m['delegate_bytes'] / 1024:.1f} KB); {m['operators']} operator kinds; arenas {m['planned_arena_bytes']} B"
        )
    c, n = r["constant_segment"], r["named_data"]
    lines.append(
        f"constant segment: {c['buffers']} tensors, {c['bytes'] / mib:.2f} MiB, shared by all methods: {c['shared_bytes'] / mib:.2f} MiB"
    )
    lines.append(
        f"named data: {n['entries']} entries, {n['bytes'] / mib:.2f} MiB, shared by all methods: {n['shared_bytes'] / mib:.2f} MiB"
    )
    w = r["weights"]
    lines.append(
        f"weights: {w['bytes'] / mib:.2f} MiB; stored twice (a constant and named data with the same bytes): {w['stored_twice_bytes'] / mib:.2f} MiB; "
        f"named data read from the constant segment: {w['named_data_in_constant_segment_bytes'] / mib:.2f} MiB"
    )
    payloads = r.get("delegate_payloads", [])
    plain = defaultdict(list)  # payloads of one method and no spec to decode, summed by backend (XNNPACK: dozens)
    for p in payloads:
        if len(p["methods"]) == 1 and "qnn" not in p:
            plain[p["backend"]].append(p["bytes"])
    if plain:
        lines.append(
            "delegate payloads of one method each: "
            + ", ".join(f"{b} {len(sizes)}x, {sum(sizes) / mib:.2f} MiB" for b, sizes in plain.items())
        )
    for i, p in enumerate(payloads):
        if len(p["methods"]) == 1 and "qnn" not in p:
            continue
        shared = f"shared by {', '.join(p['methods'])}" if len(p["methods"]) > 1 else f"used by {p['methods'][0]}"
        line = f"delegate payload {i}: {p['backend']}, {p['bytes'] / 1024:.1f} KB, {shared}"
        q = p.get("qnn")
        if q and "error" not in q:
            line += (
                f"; QNN {q['soc']} (HTP {q['htp_arch']}, {q['vtcm_mb']} MB VTCM), {q.get('precision', '?')}, "
                f"weight sharing {'on' if q.get('weight_sharing') else 'off'}"
            )
        elif q:
            line += f"; QNN spec {q['error']}"
        lines.append(line)
    if r["mutable_buffers"]:
        shared = sum(b["shared"] for b in r["mutable_buffers"].values())
        lines.append(f"mutable buffers: {len(r['mutable_buffers'])}, at one shared place in every method: {shared}")
    lines.append("metadata: " + ", ".join(f"{k}={v}" for k, v in r["metadata"].items()))
    lines.append(
        "ExecuTorch's LLM runners: "
        + "; ".join(f"{name} {'yes' if why is None else f'no ({why})'}" for name, why in r["stock_runners"].items())
    )
    return "\n".join(lines)
