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
from genai_pipeline.errors import InputError
from genai_pipeline.options import CalibrationOptions, PrepareOptions, QuantOptions
from genai_pipeline.prepare import prepare
from genai_pipeline.quantize import quantize
from genai_pipeline.quantize.recipes import quantize_module
from genai_pipeline.quantize.size_budget import graph_bytes
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
    prepared = quantize(
        prepare(get_spec("smollm2-135m"), options), QuantOptions(recipe="8da4w", embedding="8w"), get_target("xnnpack")
    )
    graphs = _exported_constants(prepared)
    prefill, decode = graphs["prefill_chunk"], graphs["decode_token"]
    scales = [k for k in prefill if k.endswith("weight.scale")]
    assert len(scales) == 2 * 7 + 2  # q k v o w1 w2 w3 per layer, embedding, head
    assert set(prefill) == set(decode)
    for key in prefill:
        assert torch.equal(prefill[key], decode[key]), key
    # and they are quantized: int8 storage with scales, not float weights
    assert any(t.dtype == torch.int8 for t in prefill.values())


def test_overrides_first_match_wins_and_group_size_is_checked(tiny_eager):
    model = tiny_eager()
    plan = quantize_module(
        model, QuantOptions(recipe="8da4w", overrides=(("^output$", "8da8w"), ("w2", "fp32"), ("output", "8da4w")))
    )
    assert plan["output"] == "8da8w"
    assert (
        plan["layers.0.feed_forward.w2"] == "fp32"
        and type(model.layers[0].feed_forward.w2.weight) is torch.nn.Parameter
    )
    assert (
        plan["layers.1.attention.wq"] == "8da4w" and type(model.layers[1].attention.wq.weight) is not torch.nn.Parameter
    )
    with pytest.raises(InputError, match="multiple of --group-size 256"):
        quantize_module(tiny_eager(), QuantOptions(recipe="8da4w", group_size=256))


def test_a_group_size_that_does_not_divide_the_layers_is_one_clear_line(tmp_path, tiny_checkpoint, capsys):
    """--group-size 128 on layers 64 wide (as 128 on SmolLM2-135M's 576): refused before any calibration,
    naming the sizes that fit, no output folder."""
    out = tmp_path / "g128"
    argv = [
        "export",
        "--checkpoint",
        str(tiny_checkpoint),
        "--recipe",
        "8da4w",
        "--group-size",
        "128",
        "--out",
        str(out),
    ]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        last
        == "error: --group-size 128 does not divide the input width of the model's int4 layers (64); use --group-size 16 or 32 or 64"
    )
    assert not out.exists()


@pytest.mark.parametrize(
    "recipe,embedding,want",
    [
        ("8da4w", "auto", "4w"),
        ("8da8w", "auto", "8w"),
        ("fp32", "auto", None),
        ("8a8w", "auto", None),
        ("8da4w", "fp32", None),
        ("8da4w", "8w", "8w"),
        ("fp32", "8w", "8w"),
    ],
)
def test_embedding_follows_the_recipe_unless_told(recipe, embedding, want):
    options = QuantOptions(recipe=recipe, embedding=embedding)
    assert options.embedding == want
    assert options.is_float == (recipe == "fp32" and want is None)


def test_auto_embedding_is_quantized_with_the_linear_layers(tiny_eager):
    plan = quantize_module(tiny_eager(), QuantOptions(recipe="8da4w"))
    assert plan["tok_embeddings"] == "emb4w" and plan["output"] == "8da4w"  # GPTQ quantizes the head to 4 bits
    assert plan["layers.0.attention.wv"] == plan["layers.1.feed_forward.w2"] == "8da8w"  # wv, more_bits_layers
    assert plan["layers.0.feed_forward.w2"] == "8da4w"
    assert plan["layers.0.attention.wq"] == plan["layers.0.feed_forward.w1"] == "8da4w"
    plan = quantize_module(tiny_eager(), QuantOptions(recipe="8da4w", weight_rule="mse"))
    assert plan["output"] == "8da8w"  # uncalibrated, the LM head stays at 8 bits (head_recipe)
    plan = quantize_module(tiny_eager(), QuantOptions(recipe="8da4w", head="8da4w", keep_8bit=()))
    assert plan["output"] == "8da4w" and plan["layers.0.attention.wv"] == "8da4w"


@pytest.mark.parametrize(
    "bad", [dict(recipe="int3"), dict(embedding="2w"), dict(group_size=48), dict(overrides=(("(", "8da4w"),))]
)
def test_bad_quant_options(bad):
    with pytest.raises(InputError):
        QuantOptions(**bad)


def _inspect(folder):
    out = subprocess.run(
        [sys.executable, "-m", "genai_pipeline.cli", "inspect", str(folder / "text_decoder.pte"), "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)


def test_quantized_hybrid_program_stores_the_weights_once_and_is_small(export_reference):
    hybrid, kv, fp32 = (
        _inspect(export_reference(m, q)) for m, q in (("hybrid", Q4), ("kv", Q4), ("hybrid", QuantOptions()))
    )
    # hybrid's two more methods (prefill_chunk, prefill) add their graphs, not a weight (the table: 1 MB)
    assert hybrid["file_bytes"] - kv["file_bytes"] <= graph_bytes(4, 2), (hybrid["file_bytes"], kv["file_bytes"])
    # fp32 stores its tied table once; here the int4 head and the int8 lookup are two tables, wv
    # and some w2 are at 8 bits under 8da4w (the recipe's rules; docs/decisions/0020), and
    # rotation adds a float 256 x 256 linear before the tied head (1.5 % of the fp32 program): 0.25x of the fp32 program.
    assert hybrid["file_bytes"] <= 0.26 * fp32["file_bytes"], (hybrid["file_bytes"], fp32["file_bytes"])
    manifest = json.loads((export_reference("hybrid", Q4) / "manifest.json").read_text())
    assert (
        manifest["recipe"] == "8da4w-g32-rot-sq0.5+emb8w+attention.wv=8da8w+more_bits.w2=8da8w+edges.w1w3=8da8w"
        and manifest["quantization"]["embedding"] == "8w"
    )


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
    prefill, decode = _qparams(exported["prefill_chunk"]), _qparams(exported["decode_token"])
    assert len(prefill) == len(decode) > 20
    for p, d in zip(prefill, decode):  # every activation and weight: the same scale and zero point
        assert p[0] == d[0] and _same(p[1], d[1]) and _same(p[2], d[2]), (p, d)
    assert any(isinstance(p[1], torch.Tensor) for p in prefill)  # per-channel weight scales were compared as tensors
    weights = {k: v for k, v in exported["prefill_chunk"].state_dict().items()}
    for key, value in exported["decode_token"].state_dict().items():
        assert torch.equal(weights[key], value), key


def test_qnn_export_stops_after_quantization_with_one_clear_line(tmp_path, tiny_checkpoint, capsys):
    out = tmp_path / "qnn"
    argv = [
        "export",
        "--checkpoint",
        str(tiny_checkpoint),
        "--target",
        "qnn",
        "--recipe",
        "16a4w",
        "--calib",
        "random",
        "--calib-limit",
        "2",
        "--calib-seq-len",
        "16",
        "--max-seq-len",
        "64",
        "--prefill-len",
        "8",
        "--out",
        str(out),
    ]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: lowering to QNN needs the Qualcomm QNN SDK")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "qdq-only" and (out / "text_decoder.qdq.pt2").is_file()
    spec = manifest["compile_spec"]  # decoded from the compile specs lowering would use
    assert (spec["soc"], spec["htp_arch"], spec["weight_sharing"], spec["context_binaries"]) == (
        "SM8650",
        "V75",
        True,
        [["prefill_chunk", "decode_token"]],
    )
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
    quant = QuantOptions(
        recipe="8a8w",
        calibration=CalibrationOptions(datasets=(f"text:{REFERENCE / 'sample.txt'}",), limit=64, seq_len=256),
    )
    folder = export_reference("kv", quant)
    assert (
        main(
            [
                "eval",
                str(folder),
                "--text",
                str(REFERENCE / "heldout.txt"),
                "--max-tokens",
                "1024",
                "--window",
                "128",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    ppl = result["perplexity"]
    assert ppl["program"] <= 1.01 * ppl["float"]  # measured +0.06 % (+1.4 % with a static scale on the LM head)
    assert abs(ppl["program"] / ppl["qdq"] - 1) < 0.01  # the program runs the QDQ model it was lowered from


def _given_int4(shape, seed):
    """Random int4 values and positive and negative group scales that bf16 holds exactly."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    d = (torch.rand(shape[0], shape[1] // 32, generator=g) * 0.02 + 0.001).to(torch.bfloat16).float()
    return q, d * torch.where(torch.rand(d.shape, generator=g) < 0.5, -1.0, 1.0)


def _xnnpack_int4(q):
    """XNNPACK's stored form of int4 weights [out, in]: value + 8, two to a byte, the even column low."""
    u = (q.to(torch.int16) + 8).to(torch.uint8).reshape(-1)
    return (u[1::2] << 4 | u[::2]).numpy().tobytes()


def test_given_int4_weights_and_scales_are_what_the_program_stores(tiny_checkpoint, tmp_path):
    from genai_pipeline.compile import compile_artifacts
    from genai_pipeline.upstream.executorch_pte_reader import read_program

    options = PrepareOptions(mode="kv", max_seq_len=64, checkpoint=tiny_checkpoint)
    prepared = prepare(get_spec("smollm2-135m"), options)
    module = next(iter(prepared.artifacts.values())).module
    names = [
        "layers.0.attention.wq.weight",
        "layers.1.feed_forward.w2.weight",
        "layers.1.attention.wv.weight",
    ]  # wv: 8-bit unless given
    given = {n: _given_int4(module.get_parameter(n).shape, i) for i, n in enumerate(names)}
    q_quant = quantize(prepared, QuantOptions(recipe="8da4w", embedding="8w"), get_target("xnnpack"), given=given)
    assert (
        q_quant.quantization["rotate"] is False and "-rot" not in q_quant.recipe
    )  # given values fit their own basis only
    # What it stores: a negative scale's block negated (XNNPACK takes positive scales), -8 -> +7 there.
    want = {}
    for n, (q, d) in given.items():
        neg = (d < 0).repeat_interleave(32, dim=1)
        want[n] = (torch.where(neg, -q.to(torch.int16), q.to(torch.int16)).clamp(-8, 7).to(torch.int8), d.abs())
    constants = _exported_constants(q_quant)["decode_token"]
    for n, (q, d) in want.items():
        key = next(k for k in constants if k.endswith(n + ".qdata"))
        assert torch.equal(constants[key], q), n
        assert torch.equal(constants[key.replace(".qdata", ".scale")], d), n
    compile_artifacts(q_quant, get_target("xnnpack"), tmp_path)
    program, segment = read_program(tmp_path / "text_decoder.pte")
    stored = {entry.key: segment(entry.segment_index) for entry in program.named_data}
    blobs = set(stored.values())
    holds = lambda part: any(part in blob for blob in blobs)  # noqa: E731  wq and wv are rows of a fused weight
    for n, (q, d) in want.items():
        assert holds(_xnnpack_int4(q)), f"{n}: the program does not hold the given integers"
        assert holds(d.to(torch.bfloat16).view(torch.int16).numpy().tobytes()), (
            f"{n}: the program does not hold the given scales"
        )


def test_given_weights_are_checked(tiny_eager):
    model = tiny_eager()
    shape = model.layers[0].attention.wq.weight.shape
    with pytest.raises(InputError, match="do not match"):
        quantize_module(
            model, QuantOptions(recipe="8da4w"), {"layers.0.attention.wq.weight": _given_int4((shape[0], 32), 0)}
        )
    with pytest.raises(InputError, match="does not have"):
        quantize_module(tiny_eager(), QuantOptions(recipe="8da4w"), {"nope.weight": _given_int4(shape, 0)})
    with pytest.raises(InputError, match="need recipe 8da4w"):
        quantize_module(
            tiny_eager(), QuantOptions(recipe="8da8w"), {"layers.0.attention.wq.weight": _given_int4(shape, 0)}
        )


@pytest.mark.parametrize("rule", ["mse", "q4_0", "torchao"])
def test_4bit_rules_give_xnnpack_scales(rule):
    from genai_pipeline.quantize.weights import RULES

    w = torch.randn(64, 128) * torch.rand(64, 1)
    q, d = RULES[rule](w, 32)
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7 and d.shape == (64, 4)
    assert (d > 0).all() and torch.equal(d, d.to(torch.bfloat16).float())  # positive, as stored (bf16)
    err = {r: (torch.repeat_interleave(RULES[r](w, 32)[1], 32, 1) * RULES[r](w, 32)[0] - w).pow(2).sum() for r in RULES}
    assert err["mse"] <= min(err.values()) * 1.0001  # the search spans the others' scales


def test_gptq_beats_round_to_nearest_on_the_layer_output_and_round_trips():
    from genai_pipeline.quantize import qdq_cache
    from genai_pipeline.quantize.gptq import gptq_qparams
    from genai_pipeline.quantize.weights import mse_qparams

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 128, generator=g) @ torch.randn(128, 128, generator=g) * 0.1  # correlated inputs
    w = torch.randn(48, 128, generator=g)
    errors = {}
    for name, (q, d) in {"gptq": gptq_qparams(w, x.T @ x, 32), "mse": mse_qparams(w, 32)}.items():
        assert (d > 0).all() and int(q.min()) >= -8 and int(q.max()) <= 7
        errors[name] = (x @ (q * d.repeat_interleave(32, 1)).T - x @ w.T).pow(2).mean()
    assert errors["gptq"] < 0.7 * errors["mse"], errors
    qdq_cache.store("0" * 64, qdq_cache.Chosen({"a.weight": (q, d)}))  # the session's cache (conftest)
    q2, d2 = qdq_cache.load("0" * 64).int4["a.weight"]
    assert torch.equal(q2, q) and torch.equal(d2, d)


def _reference_gptq(w: torch.Tensor, hessian: torch.Tensor, group_size: int, damp: float = 0.01):
    """GPTQ as the paper writes it, in float64: one column at a time, its error spread over every
    later column at once; a group's scale by the same weighted search, from the weights so far."""
    from genai_pipeline.quantize.weights import wmse_qparams

    W, H = w.double().clone(), hessian.double().clone()
    n = W.shape[1]
    H += damp * H.diag().mean() * torch.eye(n, dtype=torch.float64)
    importance = H.diag().float()
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    Q, D = torch.zeros(W.shape, dtype=torch.int8), torch.zeros(W.shape[0], n // group_size)
    for j in range(n):
        if j % group_size == 0:
            d = wmse_qparams(W[:, j : j + group_size].float(), group_size, importance[j : j + group_size])[1][:, 0]
            D[:, j // group_size] = d
        q = torch.clamp(torch.round(W[:, j] / d.double()), -8, 7)
        Q[:, j] = q.to(torch.int8)
        W[:, j:] -= ((W[:, j] - q * d.double()) / U[j, j])[:, None] * U[j, j:][None, :]
    return Q, D


@pytest.mark.parametrize("n", [96, 320])  # one block of columns and a part block; blocks of 128 and a part
def test_gptq_rounds_as_the_textbook_loop(n):
    """The blocked loop (groups within blocks, each block's columns as rows) is GPTQ: on
    well-conditioned inputs it rounds as the one-column-at-a-time loop in float64 does."""
    from genai_pipeline.quantize.gptq import gptq_qparams

    g = torch.Generator().manual_seed(n)
    x = torch.randn(4 * n, n, generator=g) @ (torch.eye(n) + 0.3 * torch.randn(n, n, generator=g) / n**0.5)
    x = x * (0.5 + torch.rand(n, generator=g))  # correlated inputs of uneven scales
    w = torch.randn(64, n, generator=g) * 0.05
    (q, d), (want_q, want_d) = gptq_qparams(w, x.T @ x, 32), _reference_gptq(w, x.T @ x, 32)
    assert (q != want_q).float().mean() < 1e-3 and (d != want_d).float().mean() < 1e-2
    wq, want_wq = q * d.repeat_interleave(32, 1), want_q * want_d.repeat_interleave(32, 1)
    assert torch.allclose(wq, want_wq, rtol=0, atol=float(d.max()) * 1.01)  # at most one step apart, anywhere
    out_err = lambda v: (x @ (v - w).T).pow(2).sum()  # noqa: E731
    assert abs(out_err(wq) - out_err(want_wq)) < 1e-3 * out_err(want_wq)


def test_gptq_solves_rows_a_band_at_a_time_bit_for_bit():
    """Rows are independent given the Hessian: a layer solved a band of rows at a time (a head's
    128k rows) rounds exactly as at once, a last partial band included."""
    from genai_pipeline.quantize.gptq import gptq_qparams

    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 128, generator=g) * (0.5 + torch.rand(128, generator=g))
    w = torch.randn(9000, 128, generator=g) * 0.05
    w[:, 5] = 0  # and a column no input reaches
    x[:, 5] = 0
    q, d = gptq_qparams(w, x.T @ x, 32, band=1 << 30)
    q_bands, d_bands = gptq_qparams(w, x.T @ x, 32, band=4096)
    assert torch.equal(q, q_bands) and torch.equal(d, d_bands)


def test_weighted_mse_weighs_every_candidate_as_one_at_a_time():
    """The 31 candidate scales weighed at once choose what weighing them one by one chooses."""
    from genai_pipeline.quantize.weights import _round_scale, wmse_qparams

    g = torch.Generator().manual_seed(0)
    w, importance = torch.randn(300, 128, generator=g), torch.rand(128, generator=g) * 3
    q, d = wmse_qparams(w, 32, importance, elements=31 * 128 * 64)  # bands of 64 rows
    groups, iw = w.reshape(300, 4, 32), importance.reshape(1, 4, 32)
    best, best_d = None, None
    for c in torch.linspace(5.5, 8.5, 31).tolist():
        dc = _round_scale(groups.abs().amax(-1, keepdim=True) / c)
        err = ((torch.clamp(torch.round(groups / dc), -8, 7) * dc - groups).pow(2) * iw).sum(-1, keepdim=True)
        best, best_d = (err, dc) if best is None else (torch.minimum(err, best), torch.where(err < best, dc, best_d))
    assert (d != best_d.squeeze(-1)).float().mean() < 1e-3
    assert torch.equal(q, torch.clamp(torch.round(groups / d[..., None]), -8, 7).reshape(w.shape).to(torch.int8))


def test_gptq_solves_together_only_the_layers_that_read_one_input(tiny_eager):
    from torch import nn

    from genai_pipeline.quantize.gptq import input_hessians

    model = tiny_eager()
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "output"}
    _, shared = input_hessians(model, names, [list(range(1, 40))], 16)
    groups = {tuple(g) for g in shared.values()}
    for i in range(2):
        a, f = f"layers.{i}.attention.", f"layers.{i}.feed_forward."
        assert (a + "wk", a + "wq", a + "wv") in groups and (a + "wo",) in groups
        assert (f + "w1", f + "w3") in groups and (f + "w2",) in groups
    assert len(groups) == 2 * 4


def test_one_calibration_pass_gives_gptq_the_hessians_of_the_smoothed_model(tiny_eager):
    # quantize measures smoothing's absmax and GPTQ's X^T X in one pass, before smoothing, and
    # rescales the latter: it must be what a second pass over the smoothed model measures.
    from conftest import TINY_MAX_SEQ
    from torch import nn

    from genai_pipeline.quantize.calibration import input_statistics
    from genai_pipeline.quantize.gptq import input_hessians
    from genai_pipeline.quantize.smoothing import smooth, smoothed_hessians, smoothed_inputs, smoothing_scales

    model = tiny_eager().eval()
    ids = [(7 * i) % 300 + 1 for i in range(48)]
    names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "output"}
    absmax, before = input_statistics(model, [ids], TINY_MAX_SEQ, names)
    scales = smoothing_scales(model, absmax, alpha=0.5)
    smooth(model, scales)
    divided = smoothed_inputs(model, scales)
    assert set(divided) == names  # every linear of a block reads a smoothed input
    predicted = smoothed_hessians({n: h.clone() for n, h in before.items()}, divided)  # in place
    measured = input_hessians(model, names, [ids], TINY_MAX_SEQ)[0]
    for name in names:
        torch.testing.assert_close(
            predicted[name], measured[name], rtol=1e-4, atol=1e-4 * measured[name].abs().max().item()
        )
        assert not torch.allclose(before[name], measured[name], rtol=1e-2)  # smoothing did change it


def test_smoothing_keeps_the_float_function_and_balances_inputs_and_weights(tiny_eager):
    from conftest import TINY_MAX_SEQ

    from genai_pipeline.quantize.calibration import input_absmax
    from genai_pipeline.quantize.smoothing import smooth, smoothing_scales

    model = tiny_eager().eval()
    ids = [(7 * i) % 300 + 1 for i in range(48)]
    with torch.no_grad():
        before = model(torch.tensor([ids]), torch.tensor([0]))
    scales = smoothing_scales(model, input_absmax(model, [ids], TINY_MAX_SEQ), alpha=0.5)
    sites = ("attention_norm", "ffn_norm", "feed_forward.w3", "attention.wv")
    assert set(scales) == {f"layers.{i}.{s}" for i in range(2) for s in sites}
    smooth(model, scales)
    with torch.no_grad():
        after = model(torch.tensor([ids]), torch.tensor([0]))
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)  # the same function
    # alpha 0.5: each input channel's largest magnitude now equals its weight column's (w2 reads only w3's product)
    absmax = input_absmax(model, [ids], TINY_MAX_SEQ)
    for i in range(2):
        w2 = model.layers[i].feed_forward.w2.weight
        torch.testing.assert_close(
            absmax[f"layers.{i}.feed_forward.w2"], w2.detach().abs().amax(0), rtol=1e-3, atol=1e-6
        )


def test_int4_values_round_trip_two_a_byte():
    """What the QDQ cache keeps gives back every int4 value exactly; consumed,
    the packed entries are dropped as they are unpacked."""
    from genai_pipeline.quantize.weights import packed_int4, unpacked_int4

    g = torch.Generator().manual_seed(0)
    given = {
        "a.weight": (torch.randint(-8, 8, (64, 96), generator=g).to(torch.int8), torch.rand(64, 3, generator=g)),
        "b.weight": (torch.randint(-8, 8, (3, 32), generator=g).to(torch.int8), torch.rand(3, 1, generator=g)),
    }
    packed = packed_int4(given)
    for got in (unpacked_int4(packed), unpacked_int4(packed, consume=True)):
        assert got.keys() == given.keys()
        for name, (q, d) in given.items():
            assert got[name][0].dtype == torch.int8 and torch.equal(got[name][0], q)
            assert torch.equal(got[name][1], d.to(torch.bfloat16).float())
    assert packed == {}
