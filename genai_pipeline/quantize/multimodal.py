"""quantize, for a vision-language model: each component with its own recipe, through the text path's
functions (the text path's, not copies).

- text decoder: `--recipe` as for a text model (8da4w: GPTQ on calibration text, the value and
  down projections at 8 bits, a tied 4-bit table's first rows at 8 bits, ...), token table by
  `--embedding`. Rotated as a text decoder is, the connector's output with its residual stream
  (rotate_as_recipe); not smoothed.
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
- static `8a8w` (xnnpack): multimodal_static.py; not for Gemma 3, whose image tokens attend both
  ways (refused). QNN's static recipes need the decoder's cache-I/O form, which the
  vision-language path does not have yet: refused.

Each component's rules (layer_rules.Rule, first match wins) are recorded in the manifest: the
decoder's as a text model's (`rules`), the tower's as `vision_rules`; `genai eval` applies them again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from genai_pipeline.artifacts import PreparedModel
from genai_pipeline.errors import InputError
from genai_pipeline.layer_rules import Rule, rules_naming
from genai_pipeline.names import ArtifactKey
from genai_pipeline.options import QuantOptions
from genai_pipeline.quantize.gptq import gptq_int4, gptq_names
from genai_pipeline.quantize.recipes import (
    HEAD,
    describe,
    for_decoder,
    linear_recipes,
    quantize_module,
    recipe_counts,
    rules_for,
    split_tied_table,
    table_8bit_rows,
)
from genai_pipeline.quantize.rotation import SEED, can_rotate, rotate, rotate_inputs, rotates_inputs

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


def check_vision_language_quant(
    options: QuantOptions,
    split: bool = False,
    target=None,
    image_attention_both_ways: bool = False,
    mrope: bool = False,
) -> None:
    """Refuse, before any work, what a vision-language export cannot do yet. `target`: a
    targets.Target (its recipes are checked by targets.check_recipe); `image_attention_both_ways`:
    the model's image tokens see each other both ways (Gemma 3); `mrope`: its text decoder takes
    M-RoPE positions (Qwen2.5-VL)."""
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
    if image_attention_both_ways:  # multimodal_static.py calibrates the causal decoder (DecoderOnEmbeddings)
        raise InputError(
            f"--recipe {options.recipe} is not built for a model whose image tokens attend to each other both ways "
            "(Gemma 3); use --recipe 8da4w or 8da8w"
        )
    if mrope:  # multimodal_static.py calibrates the decoder with plain positions (DecoderOnEmbeddings)
        raise InputError(
            f"--recipe {options.recipe} is not built for a text decoder with M-RoPE positions (Qwen2.5-VL); "
            "use --recipe 8da4w or 8da8w"
        )
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
    return dataclasses.replace(options, vision_recipe=None, vision_rules=None)


def narrow_layers(tower: nn.Module, options: QuantOptions) -> list[str]:
    """The tower's linears whose input width `--group-size` does not divide: under a 4-bit vision
    recipe, 8da8w (int8, one scale per output channel) instead of refused."""
    if options.vision_recipe != "8da4w":
        return []
    return sorted(
        n for n, m in tower.named_modules() if isinstance(m, nn.Linear) and m.in_features % options.group_size
    )


def tower_options(tower: nn.Module, options: QuantOptions) -> QuantOptions:
    """The text path's options for the tower's linears: `vision_rules`, or by default every linear
    at the vision recipe but the narrow ones (narrow_layers); no embedding (the position table
    stays float), no LM head."""
    recipe = options.vision_recipe
    rules = options.vision_rules
    if rules is None:
        rules = (*rules_naming(narrow_layers(tower, options), "8da8w"), Rule(".*", recipe))
    return QuantOptions(
        recipe=recipe,
        group_size=options.group_size,
        embedding=None,
        weight_rule="mse" if options.weight_rule == "gptq" else options.weight_rule,
        rules=rules,
    )


def rotate_as_recipe(model: nn.Module, options: QuantOptions) -> None:
    """Under a recipe that rotates (`options.rotate`), rotate a VisionLanguageModel's decoder in place
    as the text path rotates a text decoder: its residual stream, with the connector's last linear
    (whose output the stream takes as image embeddings) writing Q^T W; or, with sandwich norms
    (Gemma 3), its linears' inputs at run time, which leaves the stream and so the connector as they
    are. Before GPTQ measures the decoder, and again when `genai eval` rebuilds the model."""
    if not options.rotate:  # nor under fp32 or a static recipe (options.QuantOptions)
        return
    decoder = model.decoder
    if rotates_inputs(decoder):
        for block in decoder.layers:
            rotate_inputs(block, SEED)
    elif can_rotate(decoder):
        connector = [m for m in model.vision.projection.modules() if isinstance(m, nn.Linear)]
        rotate(decoder, SEED, writers=connector[-1:])


def quantize_model(model: nn.Module, options: QuantOptions, int4=None) -> dict[str, dict[str, str]]:
    """Quantize a VisionLanguageModel in place (`options` resolved); `int4`: the decoder's GPTQ
    weights. Returns each component's plan, {layer: recipe}."""
    plans = {"text_decoder": {}, "vision_encoder": {}}
    decoder = decoder_options(options)
    if not decoder.is_float:
        given = dict(int4 or {})  # `int4` keeps the whole head's values: what eval is given again
        if decoder.table_8bit_rows:
            split_tied_table(model.decoder, decoder.table_8bit_rows, given)
        plans["text_decoder"] = quantize_module(model.decoder, decoder, given)
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
            "recipe": describe(decoder_options(options)),
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
    """A dynamic recipe (a static one: multimodal_static.quantize_static)."""
    check_vision_language_quant(options, target=target)
    _check_calibration_images(options)
    # not smoothed: SmoothQuant measures the text path's blocks as it streams them (streaming.py)
    options = dataclasses.replace(resolved(options), smooth=None)
    if options.is_float:
        return prepared
    artifact = prepared.artifacts[ArtifactKey.MULTIMODAL]
    model = artifact.module
    options = for_decoder(options, model.decoder)
    # the table's first rows at 8 bits as in a text decoder, counted (or an explicit number refused) before any work
    head = linear_recipes(model.decoder, decoder_options(options)).get(HEAD)
    options = dataclasses.replace(options, table_8bit_rows=table_8bit_rows(options, model.decoder, head))
    rotate_as_recipe(model, options)
    computed, decoder = None, decoder_options(options)
    if options.weight_rule == "gptq" and gptq_names(model.decoder, decoder):
        computed = gptq_int4(prepared, model.decoder, decoder)
    # the rules applied, which the manifest records and `genai eval` applies again
    taken = [k.removesuffix(".weight") for k in computed or {}]
    options = dataclasses.replace(
        options,
        rules=rules_for(decoder, len(model.decoder.layers), taken),
        vision_rules=tower_options(model.vision, options).rules,
    )
    plans = quantize_model(model, options, computed)
    narrow = narrow_layers(model.vision, options)
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
    vision = dict(prepared.vision)
    vision["components"] = {k: {**v, **recipes[k]} for k, v in vision["components"].items()}
    return dataclasses.replace(
        prepared,
        # compile keeps the GPTQ weights in the QDQ cache: eval and the report rebuild the quantized model from them
        artifacts={artifact.key: dataclasses.replace(artifact, int4=computed)},
        recipe=describe(options),
        quantization=dataclasses.asdict(options),
        vision=vision,
    )


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
