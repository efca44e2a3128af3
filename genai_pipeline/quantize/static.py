"""quantize, the static recipes' PT2E path: the quantize graph calibrated into a QDQ model, the
deploy graph taken from it, and the key under which an export reuses it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from genai_pipeline.artifacts import Artifact, GraphBundle, PreparedModel
from genai_pipeline.chat_template import read_chat_template
from genai_pipeline.data import calibration_steps, iterate_with_progress
from genai_pipeline.export_folder import tool_versions
from genai_pipeline.models.cache_io import CacheIODriver, eager_runner
from genai_pipeline.names import GraphName
from genai_pipeline.options import QuantOptions
from genai_pipeline.quantize.calibration import with_default_data

log = logging.getLogger(__name__)


def calibrate(prepared: PreparedModel, artifact: Artifact, options: QuantOptions, quantizer):
    """PT2E on the quantize graph: observe activations over the calibration data, then convert."""
    from genai_pipeline.tokenizer import Tokenizer
    from genai_pipeline.upstream.executorch_logs import native_logs_hidden

    graph = artifact.quantize_graph
    checkpoint = prepared.tokenizer_file.parent if prepared.tokenizer_file else None
    tokenizer = Tokenizer.from_folder(checkpoint, bos_id=prepared.spec.bos_id) if checkpoint else None
    data = with_default_data(options.calibration)
    if any(d.kind == "random" for d in data.datasets):  # here, where activation ranges are really set from them
        log.warning(
            "calibrating %s on RANDOM tokens: the quantized model's accuracy will suffer; "
            "pass real data with --calib text:FILE (or messages, hf-chat, lm-eval)",
            artifact.key.value,
        )
    steps = calibration_steps(
        data,
        tokenizer,
        chunk_len=prepared.options.prefill_len,
        max_seq_len=prepared.options.max_seq_len,
        vocab_size=prepared.config.vocab_size,
        chat_template=read_chat_template(checkpoint) if checkpoint else None,
        seed=prepared.options.seed,
    )

    def run(observed) -> None:
        feed = _cache_io_feed(observed, graph.metadata["cache_io"]) if "cache_io" in graph.metadata else None
        for step in iterate_with_progress(steps, f"calibrating {artifact.key.value}"):
            # A new sample restarts at position 0: causal attention never reads the stale rows.
            with native_logs_hidden():  # ExecuTorch's custom ops log from C++ in eager mode too
                if feed is not None:
                    feed(step)
                else:
                    observed(step.tokens[:, : step.n_real], step.input_pos)

    return calibrated_graph(graph, quantizer, run)


def calibrated_graph(graph: GraphBundle, quantizer, run: Callable[[nn.Module], None]):
    """PT2E on one graph: exported, annotated by `quantizer` (the exported graph module -> a PT2E
    quantizer), `run(observed)` feeds the calibration data through the observed module, then
    converted; the QDQ model, exported again (an ExportedProgram) with the graph's inputs."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    exported = torch.export.export(
        graph.module, graph.example_inputs, dynamic_shapes=graph.dynamic_shapes, strict=False
    )
    observed = prepare_pt2e(exported.module(), quantizer(exported.graph_module))
    with torch.no_grad():
        run(observed)
    qdq = convert_pt2e(observed)
    return torch.export.export(qdq, graph.example_inputs, dynamic_shapes=graph.dynamic_shapes, strict=False)


def _cache_io_feed(observed, contract):
    """Calibration of a cache-I/O quantize graph: each step's chunk goes through the form's driver
    (models/cache_io.py), as the runtime's does, which owns the KV cache and builds positions and
    masks as a device does (a chunk shorter than the prefill length left-padded), so the observers
    see the inputs the deploy graphs will see."""
    driver = CacheIODriver(
        contract, eager_runner({GraphName.PREFILL_CHUNK: observed, GraphName.DECODE_TOKEN: observed}, contract.n_layers)
    )

    def feed(step) -> None:  # a new sample starts at position 0: the rows past it are never seen
        driver.feed(step.tokens[0, : step.n_real].tolist(), int(step.input_pos[0]))

    return feed


def next_token_only(qdq) -> nn.Module:
    """The calibrated QDQ model as a deploy graph: the next token's logits only, [1, vocab], as
    every deploy graph returns them (prepare's DecoderGraph(last_only=True)). The quantize graph
    computes every position's logits so that calibration sees every position; here the rows are
    dropped where the float decoder drops them, at the final norm's input: the norm and the LM head
    work row by row, so the last row's values are unchanged and the LM head runs on one row, not
    a whole prefill chunk. The graph is the same for every deploy graph: one set of encodings."""
    module = qdq.module()
    graph = module.graph

    def in_final_norm(node) -> bool:  # the decoder's top-level `norm` (DecoderGraph.decoder.norm), not a layer's
        stack = node.meta.get("nn_module_stack") or {}
        return any(re.fullmatch(r"(?:\w+\.)?norm", path) for path, _ in stack.values())

    order = {n: i for i, n in enumerate(graph.nodes)}
    norm_nodes = [n for n in graph.nodes if in_final_norm(n)]
    # The hidden states entering the norm: [1, T, dim] inputs computed before its first node (the
    # quantize/dequantize pairs between its own ops belong to no module, so they come after).
    inputs = (
        {
            a
            for n in norm_nodes
            for a in n.all_input_nodes
            if order[a] < order[norm_nodes[0]] and getattr(a.meta.get("val"), "ndim", 0) == 3
        }
        if norm_nodes
        else set()
    )
    if not inputs:
        raise RuntimeError("the QDQ model has no final norm to take the last row at")
    for hidden in inputs:
        with graph.inserting_after(hidden):
            last = graph.call_function(torch.ops.aten.select.int, (hidden, 1, -1))
        for n in norm_nodes:
            n.replace_input_with(hidden, last)
    graph.lint()
    module.recompile()
    return module


def _fingerprint(path: Path, h) -> None:
    """Names, sizes and modification times of a file or of every file below a folder."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        stat = f.stat()
        h.update(f"{f}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())


def qdq_key(prepared: PreparedModel, options: QuantOptions, target_name: str) -> str:
    """A hash of everything calibration depends on: the model and its weights, the quantize
    graph's shape options, the recipe, and the calibration data files."""
    h = hashlib.sha256()
    o = prepared.options
    inputs = {
        "model": prepared.spec.name,
        "weights": prepared.weights,
        "config": dataclasses.asdict(prepared.config),
        "max_seq_len": o.max_seq_len,
        "prefill_len": o.prefill_len,
        "seed": o.seed,
        "target": target_name,
        "quant": dataclasses.asdict(options),
        "versions": tool_versions(),
    }
    h.update(json.dumps(inputs, sort_keys=True, default=str).encode())
    sources = [Path(prepared.weights)] if prepared.weights != "random" else []
    sources += [d.path for d in options.calibration.datasets if d.arg and d.path.exists()]
    for source in sources:
        _fingerprint(source, h)
    return h.hexdigest()


def cached_qdq(cache: Path | None, key: str, artifact: Artifact):
    if cache is None:
        return None
    qdq, stamp = cache / f"{artifact.key.value}.qdq.pt2", cache / f".{artifact.key.value}.qdq.key"
    if qdq.is_file() and stamp.is_file() and stamp.read_text().strip() == key:
        log.info("reusing the calibrated %s (its inputs have not changed)", qdq)
        return torch.export.load(qdq)
    return None
