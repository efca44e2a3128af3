"""The QNN path on a host without the QNN SDK: compile specs, their validation, and the
multi-graph layout through our own lowering code with a stand-in backend (qnn_standin.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from qnn_standin import StandInQnnBackend, parse, standin_target
from tqdm import tqdm

from genai_pipeline.artifacts import Artifact, GraphBundle
from genai_pipeline.compile import to_executorch
from genai_pipeline.errors import ExportError, InputError
from genai_pipeline.inspect import inspect_program
from genai_pipeline.names import ArtifactKey, GraphName
from genai_pipeline.options import QnnOptions
from genai_pipeline.targets import qnn, qnn_specs

HYBRID = ("prefill_chunk", "decode_token")


# ---- 1. compile specs -------------------------------------------------------------------------


def test_specs_name_the_soc_its_arch_and_share_weights_in_hybrid_mode():
    from executorch.backends.qualcomm.serialization.qc_schema import HtpArch, QcomChipset

    p = qnn_specs.plan(QnnOptions(soc="sm8650"), HYBRID)  # case-insensitive
    specs = qnn_specs.compile_specs(p)
    assert set(specs) == set(HYBRID) and p.groups == (HYBRID,)
    assert [s.key for s in specs["prefill_chunk"]] == ["qnn_compile_spec"]
    o = qnn_specs.decode(specs["prefill_chunk"][0].value)
    assert o.soc_info.soc_model == QcomChipset.SM8650 and o.soc_info.htp_info.htp_arch == HtpArch.V75
    assert o.soc_info.htp_info.vtcm_size_in_mb == 8
    assert o.backend_options.htp_options.use_weight_sharing and o.shared_buffer
    assert specs["prefill_chunk"][0].value == specs["decode_token"][0].value
    from executorch.backends.qualcomm.serialization.qc_schema_serialize import option_to_flatbuffer

    assert option_to_flatbuffer(o) == specs["prefill_chunk"][0].value  # decodes and re-encodes to the same bytes


def test_single_graph_emulator_and_no_weight_sharing_plans():
    kv = qnn_specs.plan(QnnOptions(soc="SM8450"), ("decode_token",))  # one graph: V69 is fine, nothing to share
    assert not kv.weight_sharing and not kv.shared_buffer and kv.groups == (("decode_token",),)
    emu = qnn_specs.plan(QnnOptions(soc="SM8650", x86_emulator=True), HYBRID)
    assert not emu.weight_sharing and not emu.shared_buffer and emu.groups == (("prefill_chunk",), ("decode_token",))
    two = qnn_specs.plan(QnnOptions(soc="SM8450", weight_sharing=False), HYBRID)  # the V69 alternative
    assert not two.weight_sharing and two.shared_buffer and two.groups == (("prefill_chunk",), ("decode_token",))
    assert not qnn_specs.describe(qnn_specs.compile_specs(two)["decode_token"][0].value)["weight_sharing"]


def test_qnn_options_pass_through_to_the_htp_options():
    p = qnn_specs.plan(
        QnnOptions(
            options=(
                "precision=fp16",
                "max_sf_buf_size=1048576",
                "use_multi_contexts=true",
                "performance_mode=high_performance",
            )
        ),
        HYBRID,
    )
    d = qnn_specs.describe(qnn_specs.compile_specs(p)["decode_token"][0].value)
    assert d["precision"] == "fp16" and d["spill_fill_bytes"] == 1 << 20 and d["multi_contexts"]
    assert d["performance_mode"] == "high_performance" and d["htp_arch"] == "V75" and d["soc"] == "SM8650"
    # without weight sharing, methods have a context binary each and may differ
    p = qnn_specs.plan(QnnOptions(weight_sharing=False, options=("decode_token:precision=fp16",)), HYBRID)
    summary = qnn_specs.summary(p)
    assert summary["precision"] == "quantized" and summary["per_method"] == {"decode_token": {"precision": "fp16"}}
    assert summary["context_binaries"] == [["prefill_chunk"], ["decode_token"]]


@pytest.mark.parametrize(
    "options, methods, message",
    [
        (QnnOptions(soc="SM9999"), HYBRID, "unknown SoC 'SM9999'; known SoCs: QCM6490, QCS9100, SA8255"),
        (
            QnnOptions(soc="sm8450"),
            HYBRID,
            "SoC SM8450 has HTP V69, and prefill_chunk and decode_token sharing weights in one context binary needs V73 or newer",
        ),
        (QnnOptions(soc="SM8350"), HYBRID, "--mode kv, or with --no-weight-sharing"),
        (
            QnnOptions(options=("decode_token:precision=fp16",)),
            HYBRID,
            "methods prefill_chunk and decode_token share one context binary but their QNN options differ in precision",
        ),
        (
            QnnOptions(options=("precision=int4",)),
            HYBRID,
            "--qnn-option precision: bad value 'int4' (one of: quantized, fp16)",
        ),
        (QnnOptions(options=("optimization_level=3",)), HYBRID, "has no such field"),
        (QnnOptions(options=("vtcm=4",)), HYBRID, "unknown key 'vtcm'"),
        (QnnOptions(options=("forward:precision=fp16",)), HYBRID, "no method 'forward'"),
    ],
)
def test_bad_qnn_input_is_one_clear_line(options, methods, message):
    with pytest.raises(InputError) as e:
        qnn_specs.plan(options, methods)
    assert message in str(e.value) and "\n" not in str(e.value)


# ---- 2. validation of what was built ------------------------------------------------------------


def test_specs_are_compared_as_enums_with_what_was_asked():
    p = qnn_specs.plan(QnnOptions(soc="SM8650"), HYBRID)
    specs = qnn_specs.compile_specs(p)
    qnn_specs.check_specs(specs, p)  # the decoded SoC is an enum: comparing it with "SM8650" would always fail
    other = qnn_specs.compile_specs(qnn_specs.plan(QnnOptions(soc="SM8750"), HYBRID))
    with pytest.raises(ExportError, match="names SoC SM8750, but SM8650 was asked"):
        qnn_specs.check_specs({"prefill_chunk": other["prefill_chunk"], "decode_token": specs["decode_token"]}, p)
    fp16 = qnn_specs.compile_specs(qnn_specs.plan(QnnOptions(options=("precision=fp16",)), HYBRID))
    with pytest.raises(ExportError, match="share one QNN context binary but carry different compile specs"):
        qnn_specs.check_specs({"prefill_chunk": specs["prefill_chunk"], "decode_token": fp16["decode_token"]}, p)


# ---- 3. one multi-graph payload, through our own lowering ---------------------------------------


class _Core(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(64, 96)  # 24 KiB of weights, shared by both methods


class _Method(torch.nn.Module):
    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, x):
        return torch.relu(self.core.proj(x))


def _artifact() -> Artifact:
    core = _Core()
    graphs = {
        GraphName.PREFILL_CHUNK: GraphBundle(GraphName.PREFILL_CHUNK, _Method(core), (torch.randn(1, 8, 64),)),
        GraphName.DECODE_TOKEN: GraphBundle(GraphName.DECODE_TOKEN, _Method(core), (torch.randn(1, 1, 64),)),
    }
    return Artifact(key=ArtifactKey.TEXT_DECODER, module=core, graphs=graphs, constant_methods={"get_max_seq_len": 16})


def _program_parts(path):
    from executorch.exir._serialize._program import _flatbuffer_to_program, _get_extended_header

    data = path.read_bytes()
    header = _get_extended_header(data)
    program = _flatbuffer_to_program(data[: header.program_size])

    def segment(i):
        s = program.segments[i]
        return data[header.segment_base_offset + s.offset : header.segment_base_offset + s.offset + s.size]

    return program, segment


@pytest.fixture(scope="module")
def standin_pte(tmp_path_factory):
    StandInQnnBackend.calls.clear()
    artifact = _artifact()
    with tqdm(disable=True) as progress:
        program = to_executorch(artifact, standin_target(), progress, quantized=False)
    path = tmp_path_factory.mktemp("standin") / "text_decoder.pte"
    path.write_bytes(program.buffer)
    return path, artifact, list(StandInQnnBackend.calls)


def test_prefill_and_decode_share_one_payload_in_the_program(standin_pte):
    path, artifact, calls = standin_pte
    assert calls == [{"prefill_chunk": 1, "decode_token": 1}]  # ONE preprocess_multimethod call, equal partition counts
    program, segment = _program_parts(path)
    plans = {plan.name: plan for plan in program.execution_plan}
    assert {"prefill_chunk", "decode_token", "get_max_seq_len"} <= set(plans)
    refs = {name: [(d.id, d.processed.location, d.processed.index) for d in plans[name].delegates] for name in HYBRID}
    assert (
        len(refs["prefill_chunk"]) == 1 and refs["prefill_chunk"] == refs["decode_token"]
    )  # both methods reference one payload
    assert refs["prefill_chunk"][0][0] == "StandInQnnBackend"
    payload = segment(refs["prefill_chunk"][0][2])
    assert [s.size for s in program.segments if s.size] == [len(payload)]  # the only data in the file: stored once
    header, blob = parse(payload)
    assert set(header["methods"]) == set(HYBRID)  # every method's graph, by method name
    weight = artifact.module.proj.weight.detach().numpy().tobytes()
    assert payload.count(weight) == 1 and len(blob) == weight.__len__() + 96 * 4  # weight and bias, once
    assert path.read_bytes().count(weight) == 1  # ... and nowhere else in the file
    for name in HYBRID:  # the compile spec is readable on each delegate, and is the QNN spec asked for
        specs = {s.key: bytes(s.value) for s in plans[name].delegates[0].compile_specs}
        d = qnn_specs.describe(specs["qnn_compile_spec"])
        assert (d["soc"], d["htp_arch"], d["weight_sharing"]) == ("SM8650", "V75", True)
    assert bytes.fromhex(header["compile_spec"]) == specs["qnn_compile_spec"]


def test_inspect_shows_the_shared_payload_and_the_decoded_spec(standin_pte):
    from genai_pipeline.inspect import format_report

    path, _, _ = standin_pte
    report = inspect_program(path)
    (payload,) = report["delegate_payloads"]
    assert payload["backend"] == "StandInQnnBackend" and sorted(payload["methods"]) == ["decode_token", "prefill_chunk"]
    assert payload["bytes"] > 64 * 96 * 4
    assert (payload["qnn"]["soc"], payload["qnn"]["htp_arch"], payload["qnn"]["weight_sharing"]) == (
        "SM8650",
        "V75",
        True,
    )
    text = format_report(report)
    assert (
        "shared by decode_token, prefill_chunk" in text
        and "QNN SM8650 (HTP V75" in text
        and "weight sharing on" in text
    )


def test_without_weight_sharing_each_method_has_its_own_payload(tmp_path):
    StandInQnnBackend.calls.clear()
    with tqdm(disable=True) as progress:
        program = to_executorch(
            _artifact(), standin_target(QnnOptions(soc="SM8450", weight_sharing=False)), progress, quantized=False
        )
    path = tmp_path / "two.pte"
    path.write_bytes(program.buffer)
    assert StandInQnnBackend.calls == [{"prefill_chunk": 1}, {"decode_token": 1}]
    payloads = inspect_program(path)["delegate_payloads"]
    assert sorted(p["methods"] for p in payloads) == [["decode_token"], ["prefill_chunk"]]
    assert all(p["qnn"]["soc"] == "SM8450" and not p["qnn"]["weight_sharing"] for p in payloads)


def test_after_lowering_methods_meant_for_one_context_binary_but_split_are_caught():
    """A lowering that gave decode other specs, in a payload of its own, where one shared
    context binary was planned, is an error, not a surprise on the device."""
    target = standin_target()
    fp16 = qnn_specs.compile_specs(qnn_specs.plan(QnnOptions(options=("precision=fp16",)), HYBRID))["decode_token"]
    real = target.grouped

    def grouped(methods):
        g = real(methods)
        return dataclasses.replace(
            g, groups=(("prefill_chunk",), ("decode_token",)), compile_specs={**g.compile_specs, "decode_token": fp16}
        )

    with pytest.raises(ExportError, match="prefill_chunk and decode_token did not get one shared context binary"):
        with tqdm(disable=True) as progress:
            to_executorch(_artifact(), dataclasses.replace(target, grouped=grouped), progress, quantized=False)


def test_with_an_sdk_the_partitioner_is_qnns_on_the_same_path(tmp_path, monkeypatch):
    lib = tmp_path / "sdk" / "lib" / "x86_64-linux-clang"
    lib.mkdir(parents=True)
    (lib / "libQnnHtp.so").write_bytes(b"")
    monkeypatch.setenv("QNN_SDK_ROOT", str(tmp_path / "sdk"))
    target = qnn.configure(QnnOptions())
    assert target.lowering_blocked() is None  # no refusal in code once an SDK is there
    grouped = target.grouped(HYBRID)
    partitioner = grouped.partitioner(grouped.compile_specs["prefill_chunk"])
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner

    assert isinstance(partitioner, QnnPartitioner)
    assert partitioner.delegation_spec.backend_id == "QnnBackend"
    assert partitioner.delegation_spec.compile_specs[0].value == grouped.compile_specs["decode_token"][0].value
    monkeypatch.setenv("QNN_SDK_ROOT", "")
    assert "needs the Qualcomm QNN SDK" in qnn.TARGET.lowering_blocked()


# ---- bad input on the command line: one line, exit 2, before any work --------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--target", "qnn", "--recipe", "16a8w", "--soc", "SM9999"],
            "error: unknown SoC 'SM9999'; known SoCs: QCM6490, ",
        ),
        (
            ["--target", "qnn", "--recipe", "16a8w", "--soc", "sm8450"],
            "error: SoC SM8450 has HTP V69, and prefill_chunk and decode_token sharing weights in one context binary needs V73 or newer",
        ),
        (
            ["--target", "qnn", "--recipe", "16a8w", "--qnn-option", "decode_token:precision=fp16"],
            "error: methods prefill_chunk and decode_token share one context binary but their QNN options differ in precision",
        ),
        (
            ["--target", "xnnpack", "--recipe", "16a8w"],
            "error: target 'xnnpack' does not support recipe '16a8w' ('16a8w' is a recipe of --target qnn); it supports: fp32,",
        ),
        (["--target", "xnnpack", "--recipe", "8da4w", "--soc", "SM8750"], "error: --soc applies to --target qnn only"),
    ],
)
def test_bad_qnn_command_lines_stop_before_any_work(tmp_path, capsys, args, message):
    from genai_pipeline.cli import main

    out = tmp_path / "out"
    assert main(["export", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message), err
    assert not out.exists()  # nothing was prepared, quantized or written


def test_v69_hybrid_alternatives_pass_the_checks(capsys):
    from genai_pipeline.cli import build_parser, qnn_configured
    from genai_pipeline.targets import get_target

    for extra in (["--mode", "kv"], ["--no-weight-sharing"], ["--qnn-x86-emulator"]):
        args = build_parser().parse_args(["export", "--target", "qnn", "--soc", "SM8450", *extra, "--out", "x"])
        target = qnn_configured(get_target("qnn"), args)
        methods = ("decode_token",) if "kv" in extra else HYBRID
        assert target.compile_spec(methods)["soc"] == "SM8450"


# ---- 4. manifest, inspect and run of a QNN export ----------------------------------------------


def test_qnn_export_manifest_inspect_and_run(tmp_path, capsys):
    from genai_pipeline.artifacts import PreparedModel
    from genai_pipeline.cli import main
    from genai_pipeline.compile import compile_artifacts
    from genai_pipeline.options import PrepareOptions
    from genai_pipeline.registry import get_spec

    spec = get_spec("smollm2-135m")
    prepared = PreparedModel(
        spec=spec,
        config=spec.config,
        artifacts={ArtifactKey.TEXT_DECODER: _artifact()},
        options=PrepareOptions(mode="hybrid", max_seq_len=16, prefill_len=8),
        weights="random",
    )
    out = tmp_path / "qnn"
    compile_artifacts(prepared, standin_target(QnnOptions(soc="sm8750")), out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == "qnn" and manifest["status"] == "complete"
    cs = manifest["compile_spec"]
    assert (cs["soc"], cs["htp_arch"], cs["weight_sharing"], cs["shared_buffer"]) == ("SM8750", "V79", True, True)
    assert (
        cs["context_binaries"] == [["prefill_chunk", "decode_token"]] and cs["backend"] == "htp" and cs["vtcm_mb"] == 8
    )

    assert main(["inspect", str(out / "text_decoder.pte")]) == 0
    text = capsys.readouterr().out
    assert "delegate payload 0: StandInQnnBackend" in text and "shared by decode_token, prefill_chunk" in text
    assert "QNN SM8750 (HTP V79, 8 MB VTCM), quantized, weight sharing on" in text

    assert main(["run", str(out), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "QNN runtime libraries (libQnnHtp.so) are not on this host's library path" in err[0]


def test_with_an_sdk_multi_contexts_get_one_spill_fill_size_for_every_delegate(tmp_path, monkeypatch):
    """ExecuTorch's update_spill_fill_size reads the compiled context binaries through the SDK,
    so here it is recorded, not run: it gets every delegate of both methods, once."""
    from executorch.backends.qualcomm.utils import utils

    lib = tmp_path / "sdk" / "lib" / "x86_64-linux-clang"
    lib.mkdir(parents=True)
    (lib / "libQnnHtp.so").write_bytes(b"")
    monkeypatch.setenv("QNN_SDK_ROOT", str(tmp_path / "sdk"))
    seen = []
    monkeypatch.setattr(utils, "update_spill_fill_size", lambda modules: seen.append(modules) or 4096)
    target = standin_target(QnnOptions(options=("use_multi_contexts=true",)))
    with tqdm(disable=True) as progress:
        to_executorch(_artifact(), target, progress, quantized=False)
    assert len(seen) == 1 and len(seen[0]) == 2  # prefill's and decode's delegate, in one call
    assert all(m.backend_id == "StandInQnnBackend" for m in seen[0])
    given = qnn_specs.plan(QnnOptions(options=("use_multi_contexts=true", "max_sf_buf_size=65536")), HYBRID)
    assert qnn_specs.size_spill_fill(None, given) is None and len(seen) == 1  # a size the user gave is kept
    monkeypatch.setenv("QNN_SDK_ROOT", "")
    assert (
        qnn_specs.size_spill_fill(None, qnn_specs.plan(QnnOptions(options=("use_multi_contexts=true",)), HYBRID))
        is None
    )


def test_with_an_sdk_root_lowering_reaches_qnns_own_backend(tmp_path, monkeypatch):
    """No refusal in our code once QNN_SDK_ROOT holds libQnnHtp.so: the real path runs up to
    QNN's QnnManager, which here finds no loadable library and fails with one line."""
    lib = tmp_path / "sdk" / "lib" / "x86_64-linux-clang"
    lib.mkdir(parents=True)
    (lib / "libQnnHtp.so").write_bytes(b"")  # found by our check, not loadable
    monkeypatch.setenv("QNN_SDK_ROOT", str(tmp_path / "sdk"))
    target = qnn.configure(QnnOptions(), HYBRID)
    assert target.lowering_blocked() is None
    with pytest.raises(RuntimeError, match="Failed to initialize QNN backend"):
        with tqdm(disable=True) as progress:
            to_executorch(_artifact(), target, progress, quantized=False)


# ---- 5. the decoder's cache-I/O form through QNN's quantizer, passes and op builders --------------


@pytest.fixture(scope="module")
def qnn_form_export(tmp_path_factory):
    """A one-layer SmolLM-like checkpoint exported as `genai export --target qnn --recipe 16a8w`
    does (prepare in the cache-I/O form, QnnQuantizer calibrated, lowering with QNN's passes),
    with the stand-in backend where the SDK would partition and compile."""
    from conftest import save_hf_checkpoint

    import genai_pipeline
    from genai_pipeline.options import CalibrationOptions, PrepareOptions, QuantOptions

    checkpoint = save_hf_checkpoint(tmp_path_factory.mktemp("qnn_form_ckpt"), num_hidden_layers=1)
    options = PrepareOptions(max_seq_len=32, prefill_len=8, checkpoint=checkpoint)
    quant = QuantOptions(recipe="16a8w", calibration=CalibrationOptions(limit=4, seq_len=16))
    StandInQnnBackend.calls.clear()
    StandInQnnBackend.programs.clear()
    out = tmp_path_factory.mktemp("qnn_form") / "out"
    genai_pipeline.export("smollm2-135m", out=out, prepare=options, quant=quant, target=standin_target(), verify=False)
    return out, list(StandInQnnBackend.calls), list(StandInQnnBackend.programs)


def test_qnn_form_passes_qnns_quantizer_passes_and_op_builders(qnn_form_export):
    """The ordinary decoder stops in QNN's I64toI32 pass on its data-dependent cache position
    (`input_pos[0].item()`); the cache-I/O form goes through 16a8w quantization, QNN's export and
    edge passes, and QNN's own preprocess passes (FoldQDQ, InsertIOQDQ, LayoutTransform, ...) and
    op builders, which turn every node into a QNN op: all that runs before `Compile` needs the SDK."""
    from executorch.backends.qualcomm.qnn_preprocess import QnnBackend
    from executorch.backends.qualcomm.serialization.qc_schema import QnnExecuTorchBackendType

    _, calls, programs = qnn_form_export
    assert calls == [
        {"prefill_chunk": 1, "decode_token": 1}
    ]  # the whole graph is one partition per method, lowered together
    for method, (program,) in programs[0].items():
        ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
        data_dependent = {
            op for op in ops if "local_scalar_dense" in op or "sym_" in op or "llama." in op or "_assert" in op
        }
        assert not data_dependent, f"{method}: {data_dependent}"
        assert any("quantize_per_tensor" in op for op in ops)  # 16a8w QDQ reached the backend
        user = set(program.graph_signature.user_inputs)
        shapes = [tuple(n.meta["val"].shape) for n in program.graph.nodes if n.op == "placeholder" and n.name in user]
        rows = (
            8 if method == "prefill_chunk" else 1
        )  # static shapes: tokens, positions, mask, k and v (the partition's own order)
        assert sorted(shapes) == sorted(
            [(1, rows), (1, rows), (1, 1, rows, 32 + rows), (1, 2, 32, 16), (1, 2, 32, 16)]
        ), shapes
        wrappers = QnnBackend._build_op_wrappers(program, False, [], False, QnnExecuTorchBackendType.kHtpBackend)
        assert len(wrappers) > 20  # every node became a QNN op wrapper (an unsupported op raises)


def test_qnn_form_cache_inputs_take_the_encodings_of_the_rows_returned(qnn_form_export):
    """Past keys/values enter attention with the scale and zero point of this call's rows, the
    rows the runtime writes into the cache (targets.qnn.share_cache_encodings)."""
    import genai_pipeline.models.decoder  # noqa: F401  registers the llama ops the saved graph names

    out, _, _ = qnn_form_export
    qdq = torch.export.load(out / "text_decoder.qdq.pt2").module()
    checked = 0
    for node in qdq.graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.cat.default and len(node.args[0]) == 2:
            past, new = node.args[0]  # dequantize nodes
            source = past.args[0].args[0]  # dequantize <- quantize <- the input
            if source.op == "placeholder" and source.name.startswith(("k_past", "v_past")):
                assert past.args[1:3] == new.args[1:3], (source.name, past.args[1:3], new.args[1:3])
                checked += 1
    assert checked == 2  # k and v of the one layer


def test_qnn_form_manifest_states_the_io_contract(qnn_form_export):
    out, _, _ = qnn_form_export
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == "qnn" and manifest["status"] == "complete" and manifest["decoder_form"] == "cache-io"
    io = manifest["cache_io"]
    assert (io["n_layers"], io["n_kv_heads"], io["head_dim"], io["max_seq_len"]) == (1, 2, 16, 32)
    assert io["tokens_per_call"] == {"prefill_chunk": 8, "decode_token": 1} and io["mask_hidden"] == -255.0
    assert io["inputs"][:3] == ["tokens int64 [1, T]", "positions int64 [1, T]", "mask float32 [1, 1, T, 32 + T]"]
    assert "left-padded" in io["padding"] and "cursor..cursor+n-1" in io["cache_update"]
    assert manifest["artifacts"]["text_decoder"]["constant_methods"]["use_sdpa_with_kv_cache"] is False


def test_qnn_export_takes_the_cache_io_form(tmp_path, capsys):
    """--target qnn prepares the cache-I/O form, whose static shapes rule out --mode dynamic: one line, before any work."""
    from genai_pipeline.cli import main

    out = tmp_path / "out"
    assert main(["export", "--target", "qnn", "--recipe", "16a8w", "--mode", "dynamic", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the cache-I/O form (--cache-io, --target qnn) has static shapes" in err[0], err
    assert not out.exists()
