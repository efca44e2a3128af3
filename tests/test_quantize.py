"""The quantize stage: shared encodings across graphs, one copy of the weights, recipes and overrides."""

import json
import operator
import re
import subprocess
import sys

import pytest
import torch

from conftest import Q4, REFERENCE
from genai_pipeline.cli import main
from genai_pipeline.data import CalibrationOptions
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


@pytest.mark.parametrize("recipe,embedding,want", [
    ("8da4w", "auto", "4w"), ("8da8w", "auto", "8w"), ("fp32", "auto", None), ("8a8w", "auto", None),
    ("8da4w", "fp32", None), ("8da4w", "8w", "8w"), ("fp32", "8w", "8w"),
])
def test_embedding_follows_the_recipe_unless_told(recipe, embedding, want):
    options = QuantOptions(recipe=recipe, embedding=embedding)
    assert options.embedding == want
    assert options.is_float == (recipe == "fp32" and want is None)


def test_auto_embedding_is_quantized_with_the_linear_layers(tiny_eager):
    plan = quantize_module(tiny_eager(), QuantOptions(recipe="8da4w"))
    assert plan["tok_embeddings"] == "emb4w" and plan["output"] == "8da4w"


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
    # fp32 stores its tied table once; here the int4 head and the int8 lookup are two tables.
    assert hybrid["file_bytes"] <= 0.22 * fp32["file_bytes"], (hybrid["file_bytes"], fp32["file_bytes"])
    manifest = json.loads((export_reference("hybrid", Q4) / "manifest.json").read_text())
    assert manifest["recipe"] == "8da4w-g32+emb8w" and manifest["quantization"]["embedding"] == "8w"


def _qparams(graph_module):
    """(op, scale, zero point) of every quantize/dequantize node in graph order; per-channel
    scales and zero points are tensors the graph holds."""

    def value(arg):
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            return operator.attrgetter(arg.target)(graph_module)
        # a scale computed at run time (the LM head's per-token input): the same computation node
        return arg.name if isinstance(arg, torch.fx.Node) else arg

    return [
        (str(n.target), *[value(a) for a in n.args[1:3]])
        for n in graph_module.graph.nodes
        if n.op == "call_function" and "quantize_per" in str(n.target)
    ]


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b


def test_static_encodings_are_identical_in_prefill_and_decode(tiny_checkpoint):
    options = PrepareOptions(mode="hybrid", max_seq_len=64, prefill_len=8, checkpoint=tiny_checkpoint)
    # no --calib: random tokens, with a warning
    quant = QuantOptions(recipe="8a8w", calibration=CalibrationOptions(limit=4, seq_len=24))
    prepared = quantize(prepare(get_spec("smollm2-135m"), options), quant, get_target("xnnpack"))
    artifact = next(iter(prepared.artifacts.values()))
    assert artifact.qdq is not None
    exported = {
        name.value: torch.export.export(g.module, g.example_inputs, strict=False).module()
        for name, g in artifact.graphs.items()
    }
    prefill, decode = _qparams(exported["prefill"]), _qparams(exported["decode"])
    assert len(prefill) == len(decode) > 20
    for p, d in zip(prefill, decode):  # every activation and weight: the same scale and zero point
        assert p[0] == d[0] and _same(p[1], d[1]) and _same(p[2], d[2]), (p, d)
    assert any(isinstance(p[1], torch.Tensor) for p in prefill)  # per-channel weight scales were compared as tensors
    weights = {k: v for k, v in exported["prefill"].state_dict().items()}
    for key, value in exported["decode"].state_dict().items():
        assert torch.equal(weights[key], value), key


def test_qnn_export_stops_after_quantization_with_one_clear_line(tmp_path, tiny_checkpoint, capsys):
    out = tmp_path / "qnn"
    argv = ["export", "--checkpoint", str(tiny_checkpoint), "--target", "qnn", "--recipe", "16a4w", "--calib", "random",
            "--calib-limit", "2", "--calib-seq-len", "16", "--max-seq-len", "64", "--prefill-len", "8", "--out", str(out)]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: lowering to QNN needs the Qualcomm QNN SDK")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "qdq-only" and (out / "text_decoder.qdq.pt2").is_file()
    spec = manifest["compile_spec"]  # decoded from the compile specs lowering would use
    assert (spec["soc"], spec["htp_arch"], spec["weight_sharing"], spec["context_binaries"]) == ("SM8650", "V75", True, [["prefill", "decode"]])
    assert not (out / "text_decoder.pte").exists()
    report = (out / "quant_report.html").read_text()
    sqnr = re.findall(r"<td>layers\.(\d)</td><td class=num>([\d.]+)</td>", report)
    assert [layer for layer, _ in sqnr] == ["0", "1"] and all(float(db) > 5 for _, db in sqnr)
    assert "Worst layer" in report
    assert main(["eval", str(out), "--text", str(REFERENCE / "heldout.txt"), "--max-tokens", "100", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["perplexity"]["program"] is None and result["compared"] == "qdq"
    assert result["perplexity"]["qdq"] > 0 and 0 < result["top1_agreement"] <= 1
    assert main(["run", str(out), "--prompt", "x"]) == 2
    assert "holds only a QDQ model" in capsys.readouterr().err
    # a re-run on the same inputs reuses the calibrated model; other calibration data does not
    assert main(argv) == 2
    assert "reusing the calibrated" in capsys.readouterr().err
    assert main([a if a != "2" else "3" for a in argv]) == 2  # --calib-limit 3
    assert "reusing" not in capsys.readouterr().err


def test_8a8w_reference_program_tracks_its_float_model(export_reference, capsys):
    quant = QuantOptions(recipe="8a8w", calibration=CalibrationOptions(
        datasets=(f"text:{REFERENCE / 'sample.txt'}",), limit=64, seq_len=256))
    folder = export_reference("kv", quant)
    assert main(["eval", str(folder), "--text", str(REFERENCE / "heldout.txt"), "--max-tokens", "1024", "--window", "128", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ppl = result["perplexity"]
    assert ppl["program"] <= 1.01 * ppl["float"]  # measured +0.06 % (+1.4 % with a static scale on the LM head)
    assert abs(ppl["program"] / ppl["qdq"] - 1) < 0.01  # the program runs the QDQ model it was lowered from
