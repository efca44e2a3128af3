"""quantize: post-training quantization of an artifact's weights, before its graphs are exported.

Every graph of an artifact wraps the same eager module (see prepare.DecoderGraph), so quantizing
that module once gives `prefill` and `decode` bit-identical quantized weights, which the
backend then stores once. Recipes are torchao configs applied in eager mode:

- `8da4w`: dynamic per-token int8 activations, int4 group-wise weights (`group_size`)
- `8da8w`: dynamic per-token int8 activations, int8 per-channel weights
- embedding `8w` / `4w`: weight-only int8 per-row / int4 group-wise token embedding. By default
  (`auto`) it follows the linear recipe: `8da4w` -> `4w`, `8da8w` -> `8w`. A tied LM head is
  quantized as a linear layer either way, so an fp32 embedding would be the largest tensor left
  (SmolLM2-135M: 113 of 181 MB); `fp32` keeps it anyway.

Static recipes (`8a8w` on xnnpack; `16a8w`, `16a4w`, `16a4w_block`, `8a8w` on qnn) calibrate
activation ranges on data, with the target's PT2E quantizer, on the artifact's *quantize graph*
(dynamic length, every position). The calibrated QDQ model is then exported once per deploy
graph (prefill, decode, forward), so every graph carries the very same scales and zero points
for every weight and activation: the encodings propagate by construction.

Per-layer overrides map a regex over linear-layer names to a recipe (first match wins), e.g.
`output=8da8w` keeps the LM head at 8 bits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from genai_pipeline.bundle import Artifact, PreparedModel, tool_versions
from genai_pipeline.data import CalibrationOptions, DatasetSpec, calibration_steps, iterate_with_progress, read_chat_template
from genai_pipeline.errors import InputError

log = logging.getLogger(__name__)

LINEAR_RECIPES = ("fp32", "8da4w", "8da8w")  # torchao, in eager mode
STATIC_RECIPES = ("8a8w", "16a8w", "16a4w", "16a4w_block")  # PT2E, calibrated
EMBEDDING_RECIPES = ("4w", "8w")
AUTO_EMBEDDING = {"8da4w": "4w", "8da8w": "8w"}  # --embedding auto, by --recipe


@dataclass(frozen=True)
class QuantOptions:
    recipe: str = "fp32"
    group_size: int = 32  # int4 weights: values per scale
    embedding: str | None = "auto"  # 8w, 4w; auto: by recipe; fp32 or None: keep it float
    overrides: tuple[tuple[str, str], ...] = ()  # (regex over linear names, recipe), first match wins
    block_size: int = 64  # 16a4w_block: values per scale
    calibration: CalibrationOptions = CalibrationOptions()  # static recipes only

    def __post_init__(self):
        if self.recipe not in LINEAR_RECIPES + STATIC_RECIPES:
            raise InputError(f"unknown recipe '{self.recipe}'; known: {', '.join(LINEAR_RECIPES + STATIC_RECIPES)}")
        for _, recipe in self.overrides:
            if recipe not in LINEAR_RECIPES or self.is_static:
                raise InputError(f"overrides take {', '.join(LINEAR_RECIPES)} with a dynamic --recipe, got '{recipe}'")
        if self.embedding == "auto":
            object.__setattr__(self, "embedding", AUTO_EMBEDDING.get(self.recipe))
        if self.embedding == "fp32":
            object.__setattr__(self, "embedding", None)
        if self.is_static and self.embedding:
            raise InputError("--embedding goes with the dynamic recipes (8da4w, 8da8w); static recipes quantize what their quantizer annotates")
        if self.embedding is not None and self.embedding not in EMBEDDING_RECIPES:
            raise InputError(f"--embedding must be auto, fp32 or one of {', '.join(EMBEDDING_RECIPES)}, got '{self.embedding}'")
        if self.group_size < 1 or self.group_size & (self.group_size - 1):
            raise InputError(f"--group-size must be a power of two, got {self.group_size}")
        for pattern, _ in self.overrides:
            try:
                re.compile(pattern)
            except re.error as e:
                raise InputError(f"override pattern '{pattern}' is not a valid regex: {e}") from None

    @property
    def is_static(self) -> bool:
        return self.recipe in STATIC_RECIPES

    @property
    def is_float(self) -> bool:
        return self.recipe == "fp32" and self.embedding is None and all(r == "fp32" for _, r in self.overrides)

    def describe(self) -> str:
        parts = [self.recipe + (f"-g{self.group_size}" if self.recipe == "8da4w" else "")]
        if self.recipe == "16a4w_block":
            parts[0] += f"-b{self.block_size}"
        if self.embedding:
            parts.append(f"emb{self.embedding}")
        parts += [f"{p}={r}" for p, r in self.overrides]
        return "+".join(parts)


def quant_options_from(data: dict) -> QuantOptions:
    """The inverse of the manifest's `quantization` entry."""
    if not data:
        return QuantOptions()
    calibration = data.get("calibration") or {}
    calibration = CalibrationOptions(
        datasets=tuple(DatasetSpec(**d) for d in calibration.get("datasets", ())),
        limit=calibration.get("limit"),
        seq_len=calibration.get("seq_len", CalibrationOptions().seq_len),
    )
    overrides = tuple(tuple(o) for o in data.get("overrides", ()))
    return QuantOptions(**{**data, "overrides": overrides, "calibration": calibration})


def parse_override(text: str) -> tuple[str, str]:
    pattern, sep, recipe = text.rpartition("=")
    if not sep or not pattern:
        raise InputError(f"--quant-override takes REGEX=RECIPE (e.g. 'output=8da8w'), got '{text}'")
    return pattern, recipe


def linear_config(recipe: str, group_size: int):
    """torchao's config for a linear layer in `recipe` (8da4w, 8da8w); bench/gemv.py measures its kernels."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    if recipe == "8da4w":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))


def _embedding_config(recipe: str, group_size: int):
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    if recipe == "4w":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))


def recipe_for(name: str, options: QuantOptions) -> str:
    return next((r for pattern, r in options.overrides if re.search(pattern, name)), options.recipe)


def quantize_module(module: nn.Module, options: QuantOptions) -> dict[str, str]:
    """Quantize `module` in place; returns the recipe given to each layer."""
    from torchao.quantization import quantize_

    plan = {}
    if options.embedding:
        dim = next(m.embedding_dim for m in module.modules() if isinstance(m, nn.Embedding))
        if options.embedding == "4w" and dim % options.group_size:
            raise InputError(f"the embedding width {dim} is not a multiple of --group-size {options.group_size}; use --embedding 8w")
        quantize_(module, _embedding_config(options.embedding, options.group_size), filter_fn=lambda m, _: isinstance(m, nn.Embedding))
        plan.update({n: f"emb{options.embedding}" for n, m in module.named_modules() if isinstance(m, nn.Embedding)})
    linears = {n: recipe_for(n, options) for n, m in module.named_modules() if isinstance(m, nn.Linear)}
    for recipe in sorted(set(linears.values()) - {"fp32"}):
        chosen = {n for n, r in linears.items() if r == recipe}
        if "4w" in recipe:
            too_narrow = sorted(n for n in chosen if module.get_submodule(n).in_features % options.group_size)
            if too_narrow:
                raise InputError(f"{too_narrow[0]} has {module.get_submodule(too_narrow[0]).in_features} inputs, not a multiple of --group-size {options.group_size}")
        quantize_(module, linear_config(recipe, options.group_size), filter_fn=lambda m, fqn, chosen=chosen: fqn in chosen)
    plan.update(linears)
    return plan


def with_default_data(calibration: CalibrationOptions) -> CalibrationOptions:
    """No --calib given: random tokens (calibrating on them warns that accuracy will suffer)."""
    return calibration if calibration.datasets else dataclasses.replace(calibration, datasets=("random",))


def _calibrate(prepared: PreparedModel, artifact: Artifact, options: QuantOptions, quantizer):
    """PT2E on the quantize graph: observe activations over the calibration data, then convert."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from genai_pipeline.runtime.program import native_logs_hidden
    from genai_pipeline.runtime.tokenizer import Tokenizer

    graph = artifact.quantize_graph
    exported = torch.export.export(graph.module, graph.example_inputs, dynamic_shapes=graph.dynamic_shapes, strict=False)
    observed = prepare_pt2e(exported.module(), quantizer(exported.graph_module))
    checkpoint = prepared.tokenizer_file.parent if prepared.tokenizer_file else None
    tokenizer = Tokenizer.from_folder(checkpoint, bos_id=prepared.spec.bos_id) if checkpoint else None
    data = with_default_data(options.calibration)
    if any(d.kind == "random" for d in data.datasets):  # here, where activation ranges are really set from them
        log.warning("calibrating %s on RANDOM tokens: the quantized model's accuracy will suffer; "
                    "pass real data with --calib text:FILE (or messages, hf-chat, lm-eval)", artifact.key.value)
    steps = calibration_steps(
        data,
        tokenizer,
        chunk_len=prepared.options.prefill_len,
        max_seq_len=prepared.options.max_seq_len,
        vocab_size=prepared.config.vocab_size,
        chat_template=read_chat_template(checkpoint) if checkpoint else None,
        seed=prepared.options.seed,
    )
    with torch.no_grad():
        for step in iterate_with_progress(steps, f"calibrating {artifact.key.value}"):
            # A new sample restarts at position 0: causal attention never reads the stale rows.
            with native_logs_hidden():  # ExecuTorch's custom ops log from C++ in eager mode too
                observed(step.tokens[:, : step.n_real], step.input_pos)
    qdq = convert_pt2e(observed)
    return torch.export.export(qdq, graph.example_inputs, dynamic_shapes=graph.dynamic_shapes, strict=False)


def _next_token_only(qdq) -> nn.Module:
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
    inputs = {
        a for n in norm_nodes for a in n.all_input_nodes
        if order[a] < order[norm_nodes[0]] and getattr(a.meta.get("val"), "ndim", 0) == 3
    } if norm_nodes else set()
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
        "model": prepared.spec.name, "weights": prepared.weights, "config": dataclasses.asdict(prepared.config),
        "max_seq_len": o.max_seq_len, "prefill_len": o.prefill_len, "seed": o.seed, "target": target_name,
        "quant": dataclasses.asdict(options), "versions": tool_versions(),
    }
    h.update(json.dumps(inputs, sort_keys=True, default=str).encode())
    sources = [Path(prepared.weights)] if prepared.weights != "random" else []
    sources += [d.path for d in options.calibration.datasets if d.arg and d.path.exists()]
    for source in sources:
        _fingerprint(source, h)
    return h.hexdigest()


def _cached_qdq(cache: Path | None, key: str, artifact: Artifact):
    if cache is None:
        return None
    qdq, stamp = cache / f"{artifact.key.value}.qdq.pt2", cache / f".{artifact.key.value}.qdq.key"
    if qdq.is_file() and stamp.is_file() and stamp.read_text().strip() == key:
        log.info("reusing the calibrated %s (its inputs have not changed)", qdq)
        return torch.export.load(qdq)
    return None


def quantize(prepared: PreparedModel, options: QuantOptions, target, cache: Path | None = None) -> PreparedModel:
    """`target` (a targets.Target) supplies the quantizer of static recipes. With `cache` (the
    output folder of an earlier export), a QDQ model calibrated there on the same inputs is reused."""
    if options.is_float:
        return prepared
    artifacts = {}
    for key, artifact in prepared.artifacts.items():
        if options.is_static:
            stamp = qdq_key(prepared, options, target.name)
            qdq = _cached_qdq(cache, stamp, artifact)
            if qdq is None:
                qdq = _calibrate(prepared, artifact, options, lambda gm: target.static_quantizer(options, gm))
                log.info("quantized %s statically (%s), calibrated on %s", key.value, options.recipe,
                         ", ".join(map(str, with_default_data(options.calibration).datasets)))
            deploy = _next_token_only(qdq)
            graphs = {name: dataclasses.replace(g, module=deploy) for name, g in artifact.graphs.items()}
            artifact = dataclasses.replace(artifact, graphs=graphs, qdq=qdq, qdq_key=stamp)
        else:
            plan = quantize_module(artifact.module, options)
            counts = {r: sum(1 for v in plan.values() if v == r) for r in sorted(set(plan.values()))}
            log.info("quantized %s: %s", key.value, ", ".join(f"{n} layers {r}" for r, n in counts.items()))
        artifacts[key] = artifact
    return dataclasses.replace(
        prepared, artifacts=artifacts, recipe=options.describe(), quantization=dataclasses.asdict(options)
    )
