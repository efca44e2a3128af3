"""A sandwich-norm decoder's run-time rotations (quantize/rotation.py rotate_inputs) in a program:
a Gemma 3 shape (2 layers, width 64, random weights) at 8da4w. The rotations are lowered inside
XNNPACK's delegates (no float product is left to the portable kernels between them), the program
computes its QDQ model, and `genai eval` rebuilds that QDQ model from the manifest."""

import dataclasses

import torch
from test_tied_embedding import UNCALIBRATED_8DA4W, export, gemma3_shape, prefill_logits_match_eager

from genai_pipeline.evaluate.text import quantized_model
from genai_pipeline.inspect import read_program
from genai_pipeline.manifest import Manifest
from genai_pipeline.options import PrepareOptions
from genai_pipeline.prepare import prepare

PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")


def test_rotated_inputs_lower_inside_xnnpack_and_eval_rebuilds_them(tmp_path):
    spec = gemma3_shape()
    spec = dataclasses.replace(spec, config=dataclasses.replace(spec.config, vocab_size=512))
    prepared, pte = export(spec, dataclasses.replace(UNCALIBRATED_8DA4W, smooth=0.5), tmp_path)
    assert prepared.recipe.startswith("8da4w-g32-mse-rot+"), prepared.recipe  # SmoothQuant off: its sites are rotated
    (artifact,) = prepared.artifacts.values()
    for block in artifact.module.layers:
        rotations = (block.attention_norm.rotation, block.ffn_norm.rotation, block.attention.wo_rotation)
        assert all(r is not None for r in (*rotations, block.feed_forward.w2_rotation))
    program, _ = read_program(pte)
    for plan in program.execution_plan:
        outside = {op.name for op in plan.operators}
        assert not outside & set(PRODUCTS), (plan.name, outside)
    prefill_logits_match_eager(prepared, pte, rtol=5e-2)

    # genai eval's QDQ model, rebuilt from the manifest and the float model: the same rotations
    (reference,) = prepare(spec, PrepareOptions(max_seq_len=64, prefill_len=8, long_prefill_len=0)).artifacts.values()
    rebuilt = quantized_model(tmp_path, Manifest.read(tmp_path), reference.module)
    tokens, start = torch.tensor([list(range(5, 45, 3))]), torch.tensor([0])
    with torch.no_grad():
        want = artifact.module(tokens, start)
        for module in (artifact.module, rebuilt):
            module.reset_buffers()
        assert torch.allclose(
            rebuilt(tokens, start), artifact.module(tokens, start), rtol=0, atol=1e-4 * want.abs().max()
        )
