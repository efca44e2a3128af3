"""quantize: post-training quantization of an artifact's weights, before its graphs are exported.

A text model is quantized by text.py, a vision-language model by multimodal.py (per component; a
static recipe by multimodal_static.py, built on it); both build on the leaves (recipes, weights,
calibration, gptq, smoothing, rotation, size_budget, static) and never import each other.

Every graph of an artifact wraps the same eager module (see prepare/text.py's DecoderGraph), so quantizing
that module once gives every method (`prefill`, `decode_token`, ...) bit-identical quantized weights, which the
backend then stores once. Recipes are torchao configs applied in eager mode:

- `8da4w`: dynamic per-token int8 activations, int4 group-wise weights (`group_size`). Weights by
  `weight_rule`: `gptq` (default; calibrated on --calib's text, else DEFAULT_GPTQ_TEXT), `mse` (a
  least-squares scale search per group, no data), `q4_0` (llama.cpp's rule with positive scales),
  `torchao` (absmax / 7.5, the rule before). Which linears keep 8 bits is the recipe's rule list
  (recipes.recipe_rules: the attention's value projection, the MLP's down projection in llama.cpp's
  `use_more_bits` layers, w1 / w3 of the edge layers, the LM head unless GPTQ quantizes it).
  Scales are chosen as XNNPACK stores them: positive, bf16. With a size budget (`--size-budget
  MB`) size_budget.py chooses the 8-bit block layers by measurement instead of those rules.
  `given` int4 weights (a GGUF's) are taken as they are (`intx_weight`).
- `8da8w`: dynamic per-token int8 activations, int8 per-channel weights
- Both dynamic recipes first rotate the residual stream of the float model (rotation.py: an
  orthogonal change of basis folded into the weights; a tied head gains a float d x d linear before
  it), then smooth it (`smooth`, SmoothQuant at SMOOTH_ALPHA on the
  same calibration text as gptq): per-channel factors move activation outliers into the weights
  where a float op before the linear can absorb them; the graph is unchanged.
- embedding `8w` / `4w`: weight-only int8 per-row / int4 group-wise token embedding. By default
  (`auto`) it follows the linear recipe: `8da4w` -> `4w`, `8da8w` -> `8w`. A tied LM head is
  quantized as a linear layer either way, so an fp32 embedding would be the largest tensor left
  (SmolLM2-135M: 113 of 181 MB); `fp32` keeps it anyway.

Static recipes (`8a8w` on xnnpack; `16a8w`, `16a4w`, `16a4w_block`, `8a8w` on qnn) calibrate
activation ranges on data, with the target's PT2E quantizer, on the artifact's *quantize graph*
(dynamic length, every position). The calibrated QDQ model is then exported once per deploy
graph (prefill, decode, forward), so every graph carries the very same scales and zero points
for every weight and activation: the encodings propagate by construction.

A dynamic recipe is an ordered rule list (layer_rules.Rule: a regex over linear names, a recipe,
optionally some blocks; first match wins). Per-layer overrides (`--quant-override 'output=8da8w'`)
and a size budget's promotions are rules put before the recipe's (recipes.rules_for); the manifest
records the rules applied, and `genai eval` applies exactly those.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from genai_pipeline.artifacts import PreparedModel
from genai_pipeline.errors import InputError
from genai_pipeline.options import QuantOptions
from genai_pipeline.quantize.multimodal import quantize_vision_language
from genai_pipeline.quantize.multimodal_static import quantize_static
from genai_pipeline.quantize.text import quantize_text


def check_speech_quant(options: QuantOptions) -> None:
    """A speech model exports in float only: no recipe covers its audio tower yet."""
    if not options.is_float or options.vision_recipe is not None:
        raise InputError(
            f"a speech model exports in fp32 only so far (its audio tower has no recipe); got --recipe {options.recipe}"
            f"{' --vision-recipe ' + options.vision_recipe if options.vision_recipe else ''}: use --recipe fp32"
        )


def quantize(
    prepared: PreparedModel,
    options: QuantOptions,
    target,
    cache: Path | None = None,
    given: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    weights_folder: Path | None = None,
) -> PreparedModel:
    """`target` (a targets.Target) supplies the quantizer of static recipes. With `cache` (the
    output folder of an earlier export), a QDQ model calibrated there on the same inputs is reused.
    `given`: int4 weights taken as they are (see recipes.quantize_module). `weights_folder`: a
    folder on disk (the export's staging folder) a text decoder's quantized weights are moved to,
    memory-mapped, as they are made (streaming.quantize_blocks)."""
    if prepared.spec.audio is not None:
        check_speech_quant(options)
        return prepared
    if prepared.spec.vision is None:
        return quantize_text(prepared, options, target, cache, given, weights_folder)
    if options.is_static:
        return quantize_static(prepared, options, target)
    return quantize_vision_language(prepared, options, target)
