"""multimodal.rotate_as_recipe: a vision-language model rotated as its recipe says computes what the
float one does, for every connector kind: the residual stream rotated together with the connector's
last linear (the image embeddings enter that stream), or with sandwich norms (Gemma 3) the decoder's
linears' inputs at run time, the connector left as it was."""

from __future__ import annotations

import copy

import pytest
import torch

from genai_pipeline.models.decoder import Decoder, DecoderConfig
from genai_pipeline.models.vision import VisionEncoder, VisionLanguageModel
from genai_pipeline.models.vision_config import VisionConfig
from genai_pipeline.options import QuantOptions
from genai_pipeline.quantize.multimodal import rotate_as_recipe

TEXT_DIM = 64
CONNECTORS = {  # the connector kinds the vision families use (models/vision.py)
    "linear": dict(connector="linear", scale_factor=2),  # Idefics3 / SmolVLM: bias-free
    "mlp": dict(connector="mlp", projector_norm=True),  # LLaVA / InternVL: its last linear has a bias
    "merger": dict(  # Qwen2.5-VL: 2 x 2 patches merged, then an MLP with biases
        connector="merger", scale_factor=2, norm="rms", learned_positions=False, rope_theta=10000.0
    ),
}


def _model(connector: dict, seed: int = 0, **decoder) -> VisionLanguageModel:
    torch.manual_seed(seed)
    config = DecoderConfig(
        **{
            "vocab_size": 97,
            "dim": TEXT_DIM,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "hidden_dim": 128,
            **decoder,
        }
    )
    text = Decoder(config, 48).eval()
    vision = VisionEncoder(
        VisionConfig(
            image_size=32, patch_size=8, dim=32, n_layers=1, n_heads=2, hidden_dim=64, text_dim=TEXT_DIM, **connector
        )
    ).eval()
    model = VisionLanguageModel(text, vision).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms and biases away from their defaults, so folding them is tested
            p.add_(torch.randn_like(p) * 0.2)
    text.tie_weights()
    return model


def _logits(model: VisionLanguageModel, image: torch.Tensor) -> torch.Tensor:
    rows = torch.cat(
        [model.text_rows(torch.tensor([[5, 6]])), model.image_rows(image), model.text_rows(torch.tensor([[7, 8, 9]]))],
        1,
    )
    return model.decode(rows, torch.tensor([0]), last_only=False)


IMAGE = torch.randint(0, 256, (1, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("connector", CONNECTORS)
def test_rotated_residual_stream_takes_the_connectors_output_with_it(connector):
    model = _model(CONNECTORS[connector], tie_embeddings=True)
    rotated = copy.deepcopy(model)
    rotate_as_recipe(rotated, QuantOptions(recipe="8da4w"))
    want, got = _logits(model, IMAGE), _logits(rotated, IMAGE)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    # both kinds of rows really are in another basis: the table's and the connector's
    assert rotated.decoder.rotation_seed is not None and rotated.decoder.head_rotation is not None
    assert not torch.allclose(rotated.image_rows(IMAGE), model.image_rows(IMAGE), atol=1e-3)
    assert not torch.allclose(rotated.text_rows(torch.tensor([[5]])), model.text_rows(torch.tensor([[5]])), atol=1e-3)


def test_sandwich_norms_rotate_the_linears_inputs_and_leave_the_connector():
    gemma = dict(sandwich_norms=True, norm_unit_offset=True, qk_norm=True, tie_embeddings=True, activation="gelu_tanh")
    model = _model(dict(connector="rms_norm_linear", pool_kernel=2), **gemma)
    rotated = copy.deepcopy(model)
    rotate_as_recipe(rotated, QuantOptions(recipe="8da4w"))
    want, got = _logits(model, IMAGE), _logits(rotated, IMAGE)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    assert all(block.feed_forward.w2_rotation is not None for block in rotated.decoder.layers)
    assert torch.equal(rotated.image_rows(IMAGE), model.image_rows(IMAGE))  # the residual stream's basis kept


@pytest.mark.parametrize("options", [QuantOptions(recipe="8da4w", rotate=False), QuantOptions(recipe="fp32")])
def test_a_recipe_that_does_not_rotate_leaves_the_model(options):
    model = _model(CONNECTORS["linear"], tie_embeddings=True)
    before = copy.deepcopy(model.state_dict())
    rotate_as_recipe(model, options)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.decoder.head_rotation is None
