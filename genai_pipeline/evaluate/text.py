"""eval: how far an exported program is from its float model, on the same tokens.

Perplexity of the float model, of the quantized eager model ("qdq") and of the program;
top-1 agreement and KL divergence of the program's next-token distributions against float
(as llama.cpp's --kl-divergence reports them); per-layer SQNR of the quantized eager model's
block outputs against float.

Every position is scored with `decode_token` steps (a hybrid program's prefill methods return the
logits after a chunk's last token only). A hybrid program's `prefill_chunk` is scored too, separately:
each window is fed again in whole chunks of the prefill length, and the logits it returns at each
chunk's end are compared with float's at that position (top-1 agreement and KL, reported as
`prefill`). These are the logits `genai run` samples a reply's first token from; a partial last
chunk is left out (its logits would be its padding's).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from pathlib import Path

import torch
from tqdm import tqdm

from genai_pipeline.checkpoints import open_decoder
from genai_pipeline.checkpoints.block_loader import offload, release_block
from genai_pipeline.checkpoints.hf import random_decoder
from genai_pipeline.errors import InputError, ProgramError
from genai_pipeline.evaluate.chosen import chosen_values
from genai_pipeline.export_folder import check_weights
from genai_pipeline.heap import page_out
from genai_pipeline.limits import read_input_text
from genai_pipeline.manifest import COMPLETE, Manifest
from genai_pipeline.models.cache_io import CacheIOContract, eager_runner
from genai_pipeline.models.decoder import Decoder
from genai_pipeline.models.table_parts import TableLookup
from genai_pipeline.models.vision import VisionLanguageModel
from genai_pipeline.names import ArtifactKey, GraphName, Mode
from genai_pipeline.options import EvalOptions, quant_options_from
from genai_pipeline.quantize.rotation import unrotated
from genai_pipeline.quantize.streaming import quantize_blocks
from genai_pipeline.registry import get_spec
from genai_pipeline.runtime.cache_io import CacheIOSession
from genai_pipeline.runtime.open import open_session
from genai_pipeline.runtime.session import DecoderSession, EagerSession
from genai_pipeline.upstream.executorch_logs import native_logs_hidden


def float_model(manifest: Manifest):
    """The float model an export started from, rebuilt from its manifest: a Decoder, or for a
    vision-language export a VisionLanguageModel (decoder and image tower)."""
    spec = get_spec(manifest.entry)
    if manifest.vision is not None:
        return _float_vision_language_model(spec, manifest)
    if manifest.weights == "random":
        return random_decoder(manifest.config, manifest.max_seq_len, manifest.seed)
    decoder, loader = open_decoder(spec, manifest.checkpoint_path, manifest.max_seq_len)
    # a block at a time from the checkpoint's files: the float model of an 8B export is 32 GB
    return decoder if loader is None else offload(decoder, loader)


def _float_vision_language_model(spec, manifest: Manifest):
    from genai_pipeline.checkpoints.multimodal import load_multimodal, random_multimodal
    from genai_pipeline.models.vision_config import VisionConfig

    vision = VisionConfig.from_dict(manifest.vision["config"])
    if manifest.weights == "random":
        return random_multimodal(manifest.config, vision, manifest.max_seq_len, manifest.seed)
    return load_multimodal(spec, manifest.checkpoint_path, manifest.max_seq_len, vision)


def text_decoder(model):
    """The text decoder of a float or quantized model (a VisionLanguageModel's `decoder`; a static
    recipe's QDQ model without its tower)."""
    from genai_pipeline.quantize.multimodal import StaticVisionLanguage

    if isinstance(model, StaticVisionLanguage):
        return dataclasses.replace(model, vision=None)
    return model.decoder if isinstance(model, VisionLanguageModel) else model  # a QDQ graph has a `decoder` too


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    noise = (reference - approx).pow(2).sum().item()
    return float("inf") if noise == 0 else 10 * math.log10(reference.pow(2).sum().item() / noise)


def layer_sqnr(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> dict[str, float]:
    """SQNR (dB) of every block's output, QDQ (`got`) vs float (`want`), from `block_outputs`."""
    return {name: round(sqnr_db(want[name], got[name]), 2) for name in want if name in got}


def block_outputs(model, tokens: list[int], contract: CacheIOContract | None = None) -> dict[str, torch.Tensor]:
    """Every block's output over `tokens` from position 0, by `layers.<i>`.

    A QDQ model from `.qdq.pt2` is a flat graph: its block outputs are the residual adds that
    end each block, recognisable by the `layers.<i>` module path torch.export records. `contract`:
    the QDQ model is in the cache-I/O form and takes that form's inputs (an empty cache)."""
    from genai_pipeline.quantize.multimodal import StaticVisionLanguage

    with torch.no_grad(), native_logs_hidden():
        if isinstance(model, VisionLanguageModel):
            return _vision_language_blocks(model, tokens)
        if isinstance(model, StaticVisionLanguage):
            return _static_vision_language_blocks(model, tokens)
        return _capture_blocks(model, tokens, contract)


def report_image(size: int) -> torch.Tensor:
    """uint8 [1, 3, size, size]: gradients, a disc, a bar and seeded noise; the image a
    vision-language report runs the tower on (no image data is kept with an export)."""
    y, x = torch.meshgrid(
        torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32), indexing="ij"
    )
    img = torch.stack([255 * x / max(size - 1, 1), 255 * y / max(size - 1, 1), 128 + 100 * torch.sin((x + y) / 7)])
    disc = (x - size * 0.6) ** 2 + (y - size * 0.4) ** 2 < (size * 0.25) ** 2
    img[:, disc] = torch.tensor([230.0, 40.0, 60.0])[:, None]
    img[:, int(size * 0.7) : int(size * 0.8)] = torch.tensor([20.0, 20.0, 160.0])[:, None, None]
    img += torch.randn(img.shape, generator=torch.Generator().manual_seed(0)) * 12
    return img.clamp(0, 255).to(torch.uint8).unsqueeze(0)


def _vision_language_blocks(model: VisionLanguageModel, tokens: list[int]) -> dict[str, torch.Tensor]:
    """Every component's outputs: the token embedding's rows for `tokens`, each decoder block over
    them, and each image-tower layer and the connector over `report_image`."""
    outputs = {"token_embedding": model.decoder.embed(torch.tensor([tokens]))}
    hooks = [
        layer.register_forward_hook(
            lambda m, i, o, name=f"vision_encoder.layers.{n}": outputs.__setitem__(name, o.detach())
        )
        for n, layer in enumerate(model.vision.layers)
    ]
    try:
        outputs["vision_encoder.connector"] = model.vision(report_image(model.vision.config.image_size))
    finally:
        for h in hooks:
            h.remove()
    outputs.update({f"text_decoder.{name}": t for name, t in _capture_blocks(model.decoder, tokens, None).items()})
    return outputs


def _static_vision_language_blocks(model, tokens: list[int]) -> dict[str, torch.Tensor]:
    """`_vision_language_blocks`' outputs, under the same names, of a static recipe's QDQ graphs
    (quantize/multimodal.py's StaticVisionLanguage); without its tower, the text decoder's as a text
    model's (`layers.<i>`)."""
    embeddings = model.embed(torch.tensor([tokens]))
    decoder = _graph_blocks(model.decoder, embeddings, torch.tensor([0]))[0]
    if model.vision is None:
        return decoder
    outputs = {"token_embedding": embeddings}
    layers, features = _graph_blocks(model.vision, report_image(_image_size(model.vision)))
    outputs.update({f"vision_encoder.{name}": t for name, t in layers.items()})
    outputs["vision_encoder.connector"] = features
    outputs.update({f"text_decoder.{name}": t for name, t in decoder.items()})
    return outputs


def _image_size(graph) -> int:
    """The side of the images a QDQ tower graph takes (uint8 [1, 3, S, S])."""
    pixels = next(n for n in graph.graph.nodes if n.op == "placeholder")
    return int(pixels.meta["val"].shape[-1])


def _capture_blocks(model, tokens: list[int], contract: CacheIOContract | None) -> dict[str, torch.Tensor]:
    outputs = {}
    if isinstance(model, Decoder):

        def record(layer, output, name):
            outputs[name] = output.detach()
            page_out(layer.parameters())  # weights read from a file (quantized_model's weights_folder) go back

        hooks = [
            layer.register_forward_hook(lambda m, i, o, name=f"layers.{n}": record(m, o, name))
            for n, layer in enumerate(model.layers)
        ]
        model.forward_blocks(_embedded(model, tokens), torch.tensor([0]))  # the blocks' outputs: no head
        for h in hooks:
            h.remove()
        return {name: unrotated(model, x) for name, x in outputs.items()}
    if contract is None:
        return _graph_blocks(model, torch.tensor([tokens]), torch.tensor([0]))[0]
    empty = [
        torch.zeros(1, contract.n_kv_heads, contract.max_seq_len, contract.head_dim) for _ in range(contract.n_layers)
    ]
    return _graph_blocks(model, *contract.call_inputs(tokens, 0, len(tokens), empty, empty))[0]


def _embedded(model: Decoder, tokens: list[int]) -> torch.Tensor:
    """model.embed(tokens), a quantized table (torchao's) dequantized at the rows read only: its
    own lookup dequantizes the whole table first (a 128k x 3072 one is 1.5 GB in float, more than
    once over)."""
    lookup = model.tok_embeddings
    parts = isinstance(lookup, TableLookup)  # a table in parts: models/table_parts.py
    tables = (lookup.first.weight, lookup.rest.weight) if parts else (lookup.weight,)
    if all(type(table) in (torch.Tensor, torch.nn.Parameter) for table in tables):  # float: nothing to dequantize
        return model.embed(torch.tensor([tokens]))

    def row(i: int) -> torch.Tensor:  # id i's row, from the part that holds it
        if parts and i >= lookup.rows:
            return lookup.rest.weight[i - lookup.rows : i - lookup.rows + 1]
        return tables[0][i : i + 1]

    ids = sorted(set(tokens))
    rows = torch.nn.Embedding.from_pretrained(torch.cat([row(i).dequantize() for i in ids]))
    index = {t: i for i, t in enumerate(ids)}
    whole, model.tok_embeddings = model.tok_embeddings, rows  # model.embed's scaling applies as ever
    try:
        return model.embed(torch.tensor([[index[t] for t in tokens]]))
    finally:
        model.tok_embeddings = whole


def _graph_blocks(model, *inputs) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Every block's output (`layers.<i>`) of a flat QDQ graph run on `inputs`, and its output."""
    outputs, last_add = {}, {}  # layers.<i> -> the last add node of that block in graph order
    for node in model.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        paths = [path for path, _ in stack.values()]
        block = next((p for p in paths if re.fullmatch(r"(?:.*\.)?layers\.\d+", p)), None)
        if block and node.op == "call_function" and "add" in str(node.target):
            last_add["layers." + block.rsplit("layers.", 1)[1]] = node
    result = _Recorder(model, {n: name for name, n in last_add.items()}, outputs).run(*inputs)
    return outputs, result[0] if isinstance(result, (tuple, list)) else result


class _Recorder(torch.fx.Interpreter):
    def __init__(self, module, watch: dict, outputs: dict):
        super().__init__(module)
        self.watch, self.outputs = watch, outputs

    def run_node(self, node):
        result = super().run_node(node)
        if node in self.watch:
            self.outputs[self.watch[node]] = result.detach()
        return result


def quantized_model(
    folder: Path, manifest: Manifest, reference: Decoder, in_place: bool = False, weights_folder: Path | None = None
):
    """The QDQ model of an export: loaded from `.qdq.pt2` (static recipes), or rebuilt by applying
    the manifest's dynamic recipe to a copy of the float model (to the float model itself with
    `in_place`; an offloaded one is released, and the QDQ model rebuilt from the checkpoint). None
    for a float export. `weights_folder`: a text decoder's rebuilt blocks are moved to memory-mapped
    files there (streaming.quantize_blocks)."""
    quant = quant_options_from(manifest.quantization)
    if quant.is_float:
        return None
    if (
        quant.is_static and manifest.vision is not None
    ):  # the calibrated tower and text decoder, the float token embedding
        from genai_pipeline.quantize.multimodal import StaticVisionLanguage

        files = manifest.artifacts[ArtifactKey.MULTIMODAL].qdq
        graphs = {name: torch.export.load(Path(folder) / file).module() for name, file in files.items()}
        return StaticVisionLanguage(
            reference.decoder.embed, graphs[GraphName.VISION_ENCODER.value], graphs[GraphName.TEXT_DECODER.value]
        )
    if quant.is_static:
        qdq_file = manifest.artifacts[ArtifactKey.TEXT_DECODER].qdq
        return torch.export.load(Path(folder) / qdq_file).module()
    if manifest.vision is not None:  # every component, each with its recipe
        from genai_pipeline.quantize.multimodal import quantize_model, rotate_as_recipe

        model = reference if in_place else copy.deepcopy(reference)
        rotate_as_recipe(model, quant)
        quantize_model(model, quant, chosen_values(folder, manifest, ArtifactKey.MULTIMODAL).int4)
        return model
    if getattr(reference, "offloaded", False) and in_place:
        # given up: its outer tensors go now, not beside the chosen values and the QDQ model (a 128k-row table is GBs)
        release_block(reference)
    chosen = chosen_values(folder, manifest, ArtifactKey.TEXT_DECODER)
    if getattr(reference, "offloaded", False):  # a fresh decoder, quantized as it loads: no float model held
        model, loader = open_decoder(get_spec(manifest.entry), manifest.checkpoint_path, manifest.max_seq_len)
    else:
        model, loader = reference if in_place else copy.deepcopy(reference), None
    quantize_blocks(model, loader, quant, given=chosen.int4, scales=chosen.smoothing, weights_folder=weights_folder)
    return model


NON_FINITE = {
    "float": "the float model of {folder} gives NaN or Inf logits: its checkpoint's weights or hyperparameters are "
    "not finite; check the checkpoint",
    "qdq": "the quantized model of {folder} gives NaN or Inf logits although its float model does not: the "
    "recipe breaks this model; try another --recipe",
    "program": "the program in {folder} gives NaN or Inf logits although its float model does not: it is broken; "
    "re-export it (and report this with the command that made it)",
}


def evaluate(folder: Path, options: EvalOptions, progress: bool = True, qdq: bool = True) -> dict:
    """The program of the export in `folder` (and its QDQ model: `qdq`, or where there is no program)
    scored against its float model on options.text."""
    manifest = Manifest.read(folder)
    manifest.refuse_speech(folder, "genai eval")
    check_weights(manifest.checkpoint)  # the float model must be the one the program was made from
    max_seq_len = manifest.max_seq_len
    tokenizer = manifest.tokenizer(folder)
    tokens = tokenizer.encode(read_input_text(options.text, "--text", errors="replace"))[: options.max_tokens]
    if len(tokens) < 2:
        raise InputError(f"'{options.text}' has fewer than 2 tokens")
    window = min(options.window or max_seq_len, max_seq_len)

    # A vision-language program's text path (token_embedding, text_decoder) is scored on text alone.
    reference = float_model(manifest)
    qdq = quantized_model(folder, manifest, reference) if qdq or manifest.status != COMPLETE else None
    reference, qdq = text_decoder(reference), None if qdq is None else text_decoder(qdq)
    models = {"float": EagerSession(reference)}
    contract = CacheIOContract.from_manifest(manifest)
    if contract is not None and qdq is not None and not isinstance(qdq, Decoder):
        # a static recipe's QDQ graph in the cache-I/O form, driven as its program is (a dynamic
        # recipe's QDQ model is the eager Decoder, quantized in place)
        models["qdq"] = CacheIOSession(
            contract, eager_runner({GraphName.PREFILL_CHUNK: qdq, GraphName.DECODE_TOKEN: qdq}, contract.n_layers)
        )
    elif qdq is not None:
        models["qdq"] = EagerSession(qdq, max_seq_len)
    if manifest.status == COMPLETE:
        models["program"] = open_session(folder, verify=True)
    # Agreement and KL of the program against float; of the QDQ model where no program could be built.
    compared = "program" if "program" in models else "qdq"

    nll = {name: 0.0 for name in models}
    agree, kl, count = 0, 0.0, 0
    # (a cache-I/O program's prefill returns the same rows as its decode calls; not scored apart yet)
    program = models.get("program")
    score_prefill = (
        program is not None
        and not isinstance(program, CacheIOSession)
        and getattr(program, "mode", None) is Mode.HYBRID
    )
    prefill = {"positions": 0, "agree": 0, "kl": 0.0}
    windows = [tokens[i : i + window] for i in range(0, len(tokens) - 1, window)]
    for chunk in tqdm(windows, desc="eval", unit="window", disable=not progress, leave=False):
        if len(chunk) < 2:
            continue
        targets = torch.tensor(chunk[1:])
        logprobs = {}
        for name, model in models.items():
            model.reset()
            logits = model.score(chunk)[:-1].float()
            if not torch.isfinite(logits).all():  # a perplexity of NaN is no pass: say which model broke
                raise ProgramError(NON_FINITE[name].format(folder=folder))
            logprobs[name] = torch.log_softmax(logits, dim=-1)
            nll[name] += -logprobs[name].gather(1, targets[:, None]).sum().item()
        p, q = logprobs["float"], logprobs[compared]
        agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
        kl += (p.exp() * (p - q)).sum().item()
        count += len(targets)
        if score_prefill:
            _score_prefill(models["program"], chunk, logprobs["float"], prefill)

    result = {
        "tokens": count,
        "window": window,
        "recipe": manifest.recipe,
        "perplexity": {
            name: math.exp(nll[name] / count) if name in nll else None for name in ("float", "qdq", "program")
        },
        "compared": compared,
        "top1_agreement": agree / count,
        "kl_divergence": kl / count,
    }
    if score_prefill and prefill["positions"]:
        result["prefill"] = {
            "positions": prefill["positions"],
            "top1_agreement": prefill["agree"] / prefill["positions"],
            "kl_divergence": prefill["kl"] / prefill["positions"],
        }
    if qdq is not None:
        sample = windows[0]
        result["layer_sqnr_db"] = layer_sqnr(block_outputs(reference, sample), block_outputs(qdq, sample, contract))
    return result


def _score_prefill(session: DecoderSession, window: list[int], float_logprobs: torch.Tensor, totals: dict) -> None:
    """Add to `totals` the top-1 agreement and KL against float of the logits `prefill` returns at
    the end of each whole chunk of `window` that has a next token to predict."""
    session.reset()
    logits = session.prefill_chunks(window)
    ends = [(k + 1) * session.prefill_len - 1 for k in range(len(logits))]
    for row, end in zip(logits, ends):
        if end >= len(float_logprobs):  # the window's last token: nothing follows it to score
            continue
        p, q = float_logprobs[end], torch.log_softmax(row.float(), dim=-1)
        totals["positions"] += 1
        totals["agree"] += int(p.argmax() == q.argmax())
        totals["kl"] += (p.exp() * (p - q)).sum().item()
