"""quantize, for a vision-language model: each component with its own recipe, through the text path's
functions (the text path's, not copies).

- text decoder: `--recipe` exactly as for a text model (8da4w: GPTQ on calibration text, the
  value and down projections at 8 bits, ...), token table by `--embedding`.
- image tower and connector: `--vision-recipe`; by default (AUTO_VISION) 8da8w under a 4-bit
  decoder, else the decoder's recipe. Only their linear layers are quantized: the patch embedding
  (a convolution), the position table, the norms and the class token stay float. Under 8da4w the
  4-bit weights are chosen by the least-squares scale search (`mse`, no data: the tower is not run
  on calibration images), and a layer whose input width `--group-size` does not divide falls back
  to 8da8w (int8, one scale per output channel) instead of being refused.
- --split (one program per component) is float only: the split layout's quantized programs are
  not built yet.
- `--calib` chats with images for GPTQ are refused (it would see `<image>` tokens without the
  image's embeddings).
- static `8a8w` (xnnpack; `quantize_static`): the target's PT2E quantizer on two graphs of the one
  program, through static.py's `calibrated_graph`: the tower on the frames of the `--calib`
  chats' images (preprocessed as the runtime does), then the text decoder on each chat's whole
  prompt embedded with those frames' features spliced in, the features of the calibrated QDQ tower
  (what the program's decoder will see); the decoder's adds and multiplies stay float
  (FLOAT_DECODER_OPS). The token embedding stays float, as the text path's static recipe leaves it. QNN's static recipes need the decoder's cache-I/O form, which the
  vision-language path does not have yet: refused.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.export import Dim

from genai_pipeline.artifacts import GraphBundle, PreparedModel
from genai_pipeline.errors import InputError
from genai_pipeline.names import ArtifactKey, GraphName
from genai_pipeline.options import QuantOptions
from genai_pipeline.quantize.gptq import gptq_int4
from genai_pipeline.quantize.recipes import HEAD, quantize_module, recipe_counts
from genai_pipeline.quantize.static import calibrated_graph, next_token_only

log = logging.getLogger(__name__)

# --vision-recipe by --recipe when not given; any other decoder recipe: the same for the tower.
# 8da8w under a 4-bit decoder: the tower is a small share of the weights (SmolVLM-256M: 93 of 256 M
# parameters) read once per image, not once per token.
AUTO_VISION = {"8da4w": "8da8w"}
IMAGE_DATA = ("messages", "hf-chat")  # --calib kinds whose samples may hold images


def resolved(options: QuantOptions) -> QuantOptions:
    """`options` with its vision recipe chosen (AUTO_VISION when not given); a static recipe's
    quantizer takes every component, so it has none."""
    if options.is_static:
        return options
    return dataclasses.replace(
        options, vision_recipe=options.vision_recipe or AUTO_VISION.get(options.recipe, options.recipe)
    )


def check_vision_language_quant(options: QuantOptions, split: bool = False, target=None) -> None:
    """Refuse, before any work, what a vision-language export cannot do yet. `target`: a
    targets.Target (its recipes are checked by targets.check_recipe)."""
    if options.size_budget is not None:
        raise InputError(
            "--size-budget chooses the layers of a text decoder; vision-language models take --recipe and --vision-recipe"
        )
    if split and not (options.is_float and options.vision_recipe in (None, "fp32")):
        raise InputError(
            "--split exports float programs only so far; drop --split for a quantized vision-language export "
            "(one program, the layout ExecuTorch's MultimodalRunner runs)"
        )
    if not options.is_static:
        return
    if target is not None and target.cache_io:
        raise InputError(
            f"--target {target.name}'s static recipes need the text decoder's cache-I/O form, which vision-language "
            "models do not have yet; use --target xnnpack (--recipe 8a8w, 8da4w or 8da8w)"
        )
    if options.vision_recipe is not None:
        raise InputError(
            f"--recipe {options.recipe} quantizes the image tower with the target's quantizer too; drop --vision-recipe"
        )
    if not calibration_samples(options, with_images=True):
        raise InputError(
            f"--recipe {options.recipe} calibrates the image tower on images: pass chats with images, "
            "--calib messages:FILE.json (its image parts name local image files)"
        )


def decoder_options(options: QuantOptions) -> QuantOptions:
    return dataclasses.replace(options, vision_recipe=None)


def tower_options(tower: nn.Module, options: QuantOptions) -> QuantOptions:
    """The text path's options for the tower's linears: no embedding (the position table stays
    float), no LM head, no automatic 8-bit layers; 4-bit layers too narrow for a group fall back to
    8da8w (per-channel int8)."""
    recipe = options.vision_recipe
    narrow = []
    if recipe == "8da4w":
        narrow = sorted(
            n for n, m in tower.named_modules() if isinstance(m, nn.Linear) and m.in_features % options.group_size
        )
    return QuantOptions(
        recipe=recipe,
        group_size=options.group_size,
        embedding=None,
        head=None,
        keep_8bit=(),
        weight_rule="mse" if options.weight_rule == "gptq" else options.weight_rule,
        overrides=tuple((f"^{re.escape(n)}$", "8da8w") for n in narrow),
    )


def quantize_model(model: nn.Module, options: QuantOptions, int4=None) -> dict[str, dict[str, str]]:
    """Quantize a VisionLanguageModel in place (`options` resolved); `int4`: the decoder's GPTQ
    weights. Returns each component's plan, {layer: recipe}."""
    plans = {"text_decoder": {}, "vision_encoder": {}}
    decoder = decoder_options(options)
    if not decoder.is_float:
        plans["text_decoder"] = quantize_module(model.decoder, decoder, int4)
    if options.vision_recipe != "fp32":
        plans["vision_encoder"] = quantize_module(model.vision, tower_options(model.vision, options))
    return plans


def calibration_samples(options: QuantOptions, with_images: bool = False) -> list:
    """The samples of --calib's file-backed datasets (chats, text), the first `--calib-limit` of
    them; `with_images`: only the chats holding images. data.Sample each."""
    from genai_pipeline.data.calibration import load_dataset

    samples = []
    for spec in options.calibration.datasets:
        wanted = None if options.calibration.limit is None else options.calibration.limit - len(samples)
        if spec.kind != "random" and wanted != 0:
            samples += load_dataset(spec, wanted)
    return [s for s in samples if s.images or not with_images]


def _check_calibration_images(options: QuantOptions) -> None:
    from genai_pipeline.data.calibration import load_dataset

    if options.is_static:  # static recipes calibrate on them (quantize_static)
        return
    for spec in options.calibration.datasets:
        if spec.kind in IMAGE_DATA and any(s.images for s in load_dataset(spec, options.calibration.limit)):
            raise InputError(
                f"--calib {spec} holds images: calibrating a vision-language model's decoder on chats with images "
                "is not supported yet; pass text (--calib text:FILE) or chats without images"
            )


def component_recipes(options: QuantOptions, plans: dict[str, dict[str, str]]) -> dict[str, dict]:
    """What the manifest records per component: its recipe and how many layers took each recipe."""

    decoder_plan = plans["text_decoder"]
    embedding = {n: r for n, r in decoder_plan.items() if r.startswith("emb")}
    return {
        "vision_encoder": {"recipe": tower_recipe(options), "layers": recipe_counts(plans["vision_encoder"])},
        "token_embedding": {"recipe": options.embedding or "fp32", "layers": recipe_counts(embedding)},
        "text_decoder": {
            "recipe": decoder_options(options).describe(),
            "layers": recipe_counts({n: r for n, r in decoder_plan.items() if n not in embedding}),
        },
    }


def tower_recipe(options: QuantOptions) -> str:
    recipe = options.vision_recipe
    if recipe == "8da4w":
        rule = "mse" if options.weight_rule == "gptq" else options.weight_rule
        return f"8da4w-g{options.group_size}-{rule}"
    return recipe


def quantize_vision_language(prepared: PreparedModel, options: QuantOptions, target=None) -> PreparedModel:
    check_vision_language_quant(options, target=target)
    _check_calibration_images(options)
    if options.is_static:
        return quantize_static(prepared, options, target)
    # neither rotated nor smoothed: the text path's rotation and SmoothQuant (smoothing.py) are not
    # applied to a vision-language decoder yet (its image features enter the residual stream unrotated)
    options = dataclasses.replace(resolved(options), smooth=None, rotate=False)
    if options.is_float:
        return prepared
    artifact = prepared.artifacts[ArtifactKey.MULTIMODAL]
    model = artifact.module
    computed = None
    if options.recipe == "8da4w" and options.weight_rule == "gptq":
        computed = gptq_int4(prepared, model.decoder, decoder_options(options))
    plans = quantize_model(model, options, computed)
    narrow = tower_options(model.vision, options).overrides
    if narrow:
        log.info(
            "%d image-tower layers have an input width that --group-size %d does not divide: 8da8w (per channel) for them",
            len(narrow),
            options.group_size,
        )
    recipes = component_recipes(options, plans)
    for component, entry in recipes.items():
        log.info(
            "quantized %s: %s (%s)",
            component,
            entry["recipe"],
            ", ".join(f"{n} layers {r}" for r, n in entry["layers"].items()) or "no layers",
        )
    vision = dict(prepared.manifest_extra["vision"])
    vision["components"] = {k: {**v, **recipes[k]} for k, v in vision["components"].items()}
    return dataclasses.replace(
        prepared,
        # compile writes the GPTQ weights beside the program: eval and the report rebuild the quantized model from them
        artifacts={artifact.key: dataclasses.replace(artifact, int4=computed)},
        recipe=options.describe(),
        quantization=dataclasses.asdict(options),
        manifest_extra={**prepared.manifest_extra, "vision": vision},
    )


# ---------------------------------------------------------------- static recipes (8a8w)


# The text decoder's adds and multiplies (the residual stream, the norms' scaling, the MLP's gate)
# stay float; its linears keep static int8 inputs (after the norms, row by row comparable). The
# spliced image rows are ~30x the token embeddings (reference-vlm: std 3.0 vs 0.10), so one
# per-tensor int8 scale over the residual stream left the text rows about one step: reference-vlm's
# answer perplexity was 1.677 with them quantized, 1.4635 without (float 1.4638; docs/vision-language.md).
FLOAT_DECODER_OPS = {"add": torch.ops.aten.add.Tensor, "mul": torch.ops.aten.mul.Tensor}


def _linears_quantized(quantizer):
    """The target's quantizer (XNNPACKQuantizer: only xnnpack reaches here) with FLOAT_DECODER_OPS
    left float."""
    float_ops = set(FLOAT_DECODER_OPS.values())
    quantizer.set_filter_function(lambda node: node.target not in float_ops)
    return quantizer


class DecoderOnEmbeddings(nn.Module):
    """The text decoder on embeddings, every position's logits: the decoder's quantize graph. Its
    module paths are the text path's (`decoder.*`), so the target's quantizer finds the LM head by
    name and quantize.next_token_only the final norm."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, embeddings: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.decoder.forward_embeddings(embeddings, input_pos)


@dataclass(frozen=True)
class CalibrationChat:
    ids: list[int]  # the whole chat (template, images expanded), cut at the context
    frames: list[np.ndarray]  # uint8 [3, S, S] each: the frames whose run of image tokens is in `ids`


def calibration_chats(prepared: PreparedModel, options: QuantOptions) -> list[CalibrationChat]:
    """Each --calib chat as the runtime feeds it (runtime/chat.py; a text sample: its text's ids): rendered by the model's chat
    template (the checkpoint's, else the entry's), each image read and preprocessed by the family's processor (image_processing.py) and
    expanded where the template marks it, tokenized without added special tokens. A chat longer
    than the context is cut there; a frame whose run of image tokens the cut splits is left out
    (its tokens keep their token embeddings)."""
    from genai_pipeline.chat_template import ChatTemplate, read_chat_template, render_chat
    from genai_pipeline.image_files import read_image
    from genai_pipeline.image_processing import (
        ImageProcessing,
        expand_prompt,
        expand_rendered_chat,
        image_frames,
    )
    from genai_pipeline.tokenizer import Tokenizer

    if prepared.tokenizer_file is None:
        raise InputError("calibrating on chats needs the model's tokenizer, and the checkpoint has no tokenizer.json")
    folder = prepared.tokenizer_file.parent
    tokenizer = Tokenizer.from_folder(folder, bos_id=prepared.spec.bos_id)
    template = read_chat_template(folder)
    if (
        template is None and prepared.spec.chat_template is not None
    ):  # the entry's, which compile writes beside the program
        template = ChatTemplate(prepared.spec.chat_template)
    vision = prepared.manifest_extra["vision"]
    processing = ImageProcessing.from_dict(vision["preprocessing"])
    n, image_token, context = processing.tokens_per_image, vision["image_token_id"], prepared.options.max_seq_len
    if any(spec.kind == "random" for spec in options.calibration.datasets):
        log.warning("--calib random is not used for a vision-language model: random ids carry no image")
    chats = []
    for sample in calibration_samples(options):
        images = [image_frames(read_image(path), processing) for path in sample.images]
        if sample.text is not None:  # plain text: the text decoder alone, as the text path feeds it
            chats.append(CalibrationChat(tokenizer.encode(sample.text, add_special_tokens=True)[:context], []))
            continue
        if (
            template is None
        ):  # "role: content" lines mark no image: the images go first, as `genai run --image` puts them
            text = expand_prompt(render_chat(sample.messages, None), images, processing)
        else:
            text = expand_rendered_chat(
                render_chat(
                    sample.messages, template.source, bos_token=template.bos_token, eos_token=template.eos_token
                ),
                images,
                processing,
            )
        ids = tokenizer.encode(text, add_special_tokens=template is None)[:context]
        whole = sum(1 for t in ids if t == image_token) // n
        chats.append(CalibrationChat(ids, [frame for f in images for frame in f.pixels][:whole]))
    return chats


def spliced_embeddings(
    embed: Callable, vision: Callable, ids: list[int], frames: list[np.ndarray], image_token_id: int
) -> torch.Tensor:
    """The decoder's input for `ids`: their token embeddings, each frame's features where its run of
    image tokens is (MultimodalSession.prefill's splice, in eager mode)."""
    embeddings = embed(torch.tensor([ids]))
    slots = [i for i, t in enumerate(ids) if t == image_token_id]
    n = len(slots) // max(len(frames), 1)
    for k, frame in enumerate(frames):
        embeddings[0, slots[k * n : (k + 1) * n]] = vision(torch.from_numpy(frame).unsqueeze(0))[0]
    return embeddings


def quantize_static(prepared: PreparedModel, options: QuantOptions, target) -> PreparedModel:
    """8a8w: the tower's graph calibrated on the chats' frames, then the text decoder's on their
    spliced embeddings; the deploy methods are the calibrated QDQ graphs (the token embedding
    stays the float lookup). Both QDQ models are kept for `genai eval` and the report."""
    from genai_pipeline.data import iterate_with_progress
    from genai_pipeline.upstream.executorch_logs import native_logs_hidden

    artifact = prepared.artifacts[ArtifactKey.MULTIMODAL]
    model = artifact.module.requires_grad_(
        False
    )  # else the buffer write-back fails in to_executorch (docs/quantization.md)
    chats = calibration_chats(prepared, options)
    image_token_id = prepared.manifest_extra["vision"]["image_token_id"]
    quantizer = lambda gm: target.static_quantizer(options, gm)  # noqa: E731
    tower = artifact.graphs[GraphName.VISION_ENCODER]

    def see_frames(observed) -> None:
        for frame in iterate_with_progress([f for c in chats for f in c.frames], "calibrating vision_encoder"):
            observed(torch.from_numpy(frame).unsqueeze(0))

    vision_qdq = calibrated_graph(tower, quantizer, see_frames)
    qdq_tower = vision_qdq.module()
    dim = model.decoder.config.dim
    seq = Dim("seq_len", min=1, max=prepared.options.max_seq_len)
    graph = GraphBundle(
        GraphName.TEXT_DECODER,
        DecoderOnEmbeddings(model.decoder),
        (torch.zeros((1, 2, dim)), torch.tensor([0], dtype=torch.long)),
        dynamic_shapes=({1: seq}, None),
    )

    def see_chats(observed) -> None:
        for chat in iterate_with_progress(chats, "calibrating text_decoder"):
            # The calibrated tower's features: the ranges the program's decoder will see. Each chat
            # starts at position 0: causal attention never reads the previous chat's cache rows.
            with native_logs_hidden():  # ExecuTorch's custom ops log from C++ in eager mode too
                observed(
                    spliced_embeddings(model.decoder.embed, qdq_tower, chat.ids, chat.frames, image_token_id),
                    torch.tensor([0]),
                )

    decoder_qdq = calibrated_graph(graph, lambda gm: _linears_quantized(quantizer(gm)), see_chats)
    graphs = dict(artifact.graphs)
    graphs[GraphName.VISION_ENCODER] = dataclasses.replace(tower, module=qdq_tower)
    # the next token's logits only, as TextDecoderGraph returns them (the text path's deploy graph)
    graphs[GraphName.TEXT_DECODER] = dataclasses.replace(
        graphs[GraphName.TEXT_DECODER], module=next_token_only(decoder_qdq)
    )
    plans = {
        "vision_encoder": static_plan(vision_qdq, options.recipe),
        "text_decoder": static_plan(decoder_qdq, options.recipe),
    }
    frames = sum(len(c.frames) for c in chats)
    recipes = {
        "vision_encoder": {"recipe": options.recipe, "layers": recipe_counts(plans["vision_encoder"])},
        "token_embedding": {"recipe": "fp32", "layers": {}},
        "text_decoder": {
            "recipe": options.describe(),
            "layers": recipe_counts(plans["text_decoder"]),
            "float_ops": sorted(FLOAT_DECODER_OPS),
        },
    }
    for component, entry in recipes.items():
        log.info(
            "quantized %s: %s (%s)",
            component,
            entry["recipe"],
            ", ".join(f"{n} layers {r}" for r, n in entry["layers"].items()) or "no layers",
        )
    log.info("calibrated on %d chats, %d image frames", len(chats), frames)
    vision = dict(prepared.manifest_extra["vision"])
    vision["components"] = {k: {**v, **recipes[k]} for k, v in vision["components"].items()}
    vision["calibration"] = {"chats": len(chats), "frames": frames, "tokens": sum(len(c.ids) for c in chats)}
    qdq = {GraphName.VISION_ENCODER: vision_qdq, GraphName.TEXT_DECODER: decoder_qdq}
    return dataclasses.replace(
        prepared,
        artifacts={artifact.key: dataclasses.replace(artifact, graphs=graphs, qdq=qdq)},
        recipe=options.describe(),
        quantization=dataclasses.asdict(options),
        manifest_extra={**prepared.manifest_extra, "vision": vision},
    )


def static_plan(qdq, recipe: str) -> dict[str, str]:
    """{layer: recipe} of a calibrated graph: every module whose weight the quantizer quantized
    (linears, the tower's patch convolution); the LM head quantizes its input per token at run
    time (targets/xnnpack.py), 8da8w."""
    from torch.fx import Node

    plan = {}
    for node in qdq.graph_module.graph.nodes:
        if node.op != "call_function" or "dequantize_per_channel" not in str(node.target):
            continue
        source = node.args[0]
        # a weight: a constant (a placeholder of the exported program that is no user input)
        if not isinstance(source, Node) or source.op != "placeholder" or source.name in _user_inputs(qdq):
            continue
        stacks = [(n.meta.get("nn_module_stack") or {}) for n in node.users]
        paths = [path for stack in stacks for path, _ in stack.values()]
        if paths:
            name = max(paths, key=len).removeprefix("model.").removeprefix("decoder.")
            plan[name] = "8da8w" if name == HEAD else recipe
    return plan


def _user_inputs(qdq) -> set[str]:
    return {s.arg.name for s in qdq.graph_signature.input_specs if s.kind.name == "USER_INPUT"}


@dataclass(frozen=True)
class StaticVisionLanguage:
    """A static recipe's QDQ vision-language model as `genai eval` and the quant report run it: the
    float token embedding (the recipe leaves it float) and the calibrated graphs of the tower
    (pixels -> features) and of the text decoder (embeddings, input_pos -> every position's logits).
    `vision` None: the text path alone (`genai eval --text`)."""

    embed: Callable
    vision: nn.Module | None
    decoder: nn.Module

    def __call__(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.embed(tokens), input_pos)  # what EagerSession calls
