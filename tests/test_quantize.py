"""The quantize stage: shared encodings across graphs, one copy of the weights, recipes and overrides."""

import json
import subprocess
import sys

import pytest
import torch

from conftest import Q4
from genai_pipeline.errors import InputError
from genai_pipeline.prepare import PrepareOptions, prepare
from genai_pipeline.quantize import QuantOptions, quantize, quantize_module
from genai_pipeline.registry import get_spec
from genai_pipeline.targets import get_target


def _plain_tensors(named):
    """Quantized weights are tensor subclasses: compare their parts (int data, scales, zero points)."""
    out = {}
    for name, t in named.items():
        if hasattr(t, "__tensor_flatten__") and type(t) is not torch.nn.Parameter and type(t) is not torch.Tensor:
            for part in t.__tensor_flatten__()[0]:
                out[f"{name}.{part}"] = getattr(t, part)
        else:
            out[name] = t
    return out


def _exported_constants(prepared):
    artifact = next(iter(prepared.artifacts.values()))
    constants = {}
    for name, graph in artifact.graphs.items():
        ep = torch.export.export(graph.module, graph.example_inputs, strict=False)
        constants[name.value] = _plain_tensors({**ep.state_dict, **ep.constants})
    return constants


def test_prefill_and_decode_carry_identical_quantization_parameters(tiny_checkpoint):
    options = PrepareOptions(mode="hybrid", max_seq_len=64, prefill_len=8, checkpoint=tiny_checkpoint)
    prepared = quantize(prepare(get_spec("smollm2-135m"), options), QuantOptions(recipe="8da4w", embedding="8w"), get_target("xnnpack"))
    graphs = _exported_constants(prepared)
    prefill, decode = graphs["prefill"], graphs["decode"]
    scales = [k for k in prefill if k.endswith("weight.scale")]
    assert len(scales) == 2 * 7 + 2  # q k v o w1 w2 w3 per layer, embedding, head
    assert set(prefill) == set(decode)
    for key in prefill:
        assert torch.equal(prefill[key], decode[key]), key
    # and they are quantized: int8 storage with scales, not float weights
    assert any(t.dtype == torch.int8 for t in prefill.values())


def test_overrides_first_match_wins_and_group_size_is_checked(tiny_eager):
    model = tiny_eager()
    plan = quantize_module(model, QuantOptions(recipe="8da4w", overrides=(("^output$", "8da8w"), ("w2", "fp32"), ("output", "8da4w"))))
    assert plan["output"] == "8da8w"
    assert plan["layers.0.feed_forward.w2"] == "fp32" and type(model.layers[0].feed_forward.w2.weight) is torch.nn.Parameter
    assert plan["layers.1.attention.wq"] == "8da4w" and type(model.layers[1].attention.wq.weight) is not torch.nn.Parameter
    with pytest.raises(InputError, match="multiple of --group-size 256"):
        quantize_module(tiny_eager(), QuantOptions(recipe="8da4w", group_size=256))


@pytest.mark.parametrize("bad", [dict(recipe="int3"), dict(embedding="2w"), dict(group_size=48), dict(overrides=(("(", "8da4w"),))])
def test_bad_quant_options(bad):
    with pytest.raises(InputError):
        QuantOptions(**bad)


def _inspect(folder):
    out = subprocess.run([sys.executable, "-m", "genai_pipeline.cli", "inspect", str(folder / "text_decoder.pte"), "--json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_quantized_hybrid_program_stores_the_weights_once_and_is_small(export_reference):
    hybrid, kv, fp32 = (_inspect(export_reference(m, q)) for m, q in (("hybrid", Q4), ("kv", Q4), ("hybrid", QuantOptions())))
    assert hybrid["file_bytes"] <= 1.02 * kv["file_bytes"], (hybrid["file_bytes"], kv["file_bytes"])
    assert hybrid["file_bytes"] <= 0.2 * fp32["file_bytes"], (hybrid["file_bytes"], fp32["file_bytes"])
    manifest = json.loads((export_reference("hybrid", Q4) / "manifest.json").read_text())
    assert manifest["recipe"] == "8da4w-g32+emb8w" and manifest["quantization"]["embedding"] == "8w"
