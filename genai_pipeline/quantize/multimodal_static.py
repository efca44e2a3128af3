"""quantize, a vision-language model's static recipe (`8a8w` on xnnpack): the target's PT2E quantizer
on two graphs of the one program, through static.py's `calibrated_graph`: the tower on the frames
of the `--calib` chats' images (preprocessed as the runtime does), then the text decoder on each
chat's whole prompt embedded with those frames' features spliced in, the features of the calibrated
QDQ tower (what the program's decoder will see); the decoder's adds and multiplies stay float
(FLOAT_DECODER_OPS). The token embedding stays float, as the text path's static recipe leaves it.
Which layer takes which bits is the quantizer's choice (targets/), not a rule list's. Built on
multimodal.py (the checks, the calibration samples); the dynamic recipes never import this.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.export import Dim

from genai_pipeline.artifacts import GraphBundle, PreparedModel
from genai_pipeline.chat_template import ChatTemplate, read_chat_template, render_chat
from genai_pipeline.errors import InputError
from genai_pipeline.image_files import read_image
from genai_pipeline.image_processing import ImageProcessing, expand_prompt, expand_rendered_chat, image_frames
from genai_pipeline.names import ArtifactKey, GraphName
from genai_pipeline.options import QuantOptions
from genai_pipeline.quantize.multimodal import calibration_samples, check_vision_language_quant
from genai_pipeline.quantize.recipes import HEAD, describe, recipe_counts
from genai_pipeline.quantize.static import calibrated_graph, next_token_only
from genai_pipeline.tokenizer import Tokenizer

log = logging.getLogger(__name__)


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
    if prepared.tokenizer_file is None:
        raise InputError("calibrating on chats needs the model's tokenizer, and the checkpoint has no tokenizer.json")
    folder = prepared.tokenizer_file.parent
    tokenizer = Tokenizer.from_folder(folder, bos_id=prepared.spec.bos_id)
    template = read_chat_template(folder)
    if (
        template is None and prepared.spec.chat_template is not None
    ):  # the entry's, which compile writes beside the program
        template = ChatTemplate(prepared.spec.chat_template)
    vision = prepared.vision
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

    check_vision_language_quant(
        options, target=target, image_attention_both_ways=prepared.vision["config"]["bidirectional_image_attention"]
    )
    artifact = prepared.artifacts[ArtifactKey.MULTIMODAL]
    model = artifact.module.requires_grad_(
        False
    )  # else the buffer write-back fails in to_executorch (docs/quantization.md)
    chats = calibration_chats(prepared, options)
    image_token_id = prepared.vision["image_token_id"]
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
            "recipe": describe(options),
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
    vision = dict(prepared.vision)
    vision["components"] = {k: {**v, **recipes[k]} for k, v in vision["components"].items()}
    vision["calibration"] = {"chats": len(chats), "frames": frames, "tokens": sum(len(c.ids) for c in chats)}
    qdq = {GraphName.VISION_ENCODER: vision_qdq, GraphName.TEXT_DECODER: decoder_qdq}
    return dataclasses.replace(
        prepared,
        artifacts={artifact.key: dataclasses.replace(artifact, graphs=graphs, qdq=qdq)},
        recipe=describe(options),
        quantization=dataclasses.asdict(options),
        vision=vision,
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
