"""QNN compile specs, on any host: the SoC table, `--qnn-option` parsing, the plan of which methods
share a context binary, the specs built, decoded and checked, and the manifest's summary of them
(ExecuTorch's Qualcomm schema imports no torch and needs no SDK)."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

from genai_pipeline.errors import ExportError, InputError
from genai_pipeline.options import QnnOptions
from genai_pipeline.upstream.qnn_internals import no_download, qc_schema, soc_info_table

WEIGHT_SHARING_MIN_ARCH = 73  # HTP arch from which one context binary can share weights between graphs
SPEC_KEY = "qnn_compile_spec"  # ExecuTorch's QCOM_QNN_COMPILE_SPEC


def sdk_root() -> str | None:
    """QNN_SDK_ROOT when it holds the HTP libraries (lib/<arch>/libQnnHtp.so), else None."""
    root = os.environ.get("QNN_SDK_ROOT", "")
    return root if root and any(Path(root).glob("lib/*/libQnnHtp.so")) else None


def soc_table() -> dict:
    """SoC name -> ExecuTorch's SocInfo (chipset, HTP arch, VTCM MB). Imports no torch."""
    return {info.soc_model.name: info for info in soc_info_table().values()}


def soc_info(name: str):
    table = soc_table()
    info = table.get(name.upper())
    if info is None:
        raise InputError(f"unknown SoC '{name}'; known SoCs: {', '.join(sorted(table))}")
    return info


def _arch(info) -> int:
    return int(info.htp_info.htp_arch)


def _snake(name: str, prefix: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", name.removeprefix(prefix)).lower()


def _option_parsers() -> dict:
    """--qnn-option keys: the HTP backend options of ExecuTorch's compile spec (weight sharing
    has its own flag), each with a parser of its value."""
    s = qc_schema()

    def choice(values: dict):
        return lambda v: values[v.lower()] if v.lower() in values else _bad(v, values)

    def enum(cls):
        return choice({_snake(m.name, "kHtp"): m for m in cls})

    boolean = choice({"true": True, "false": False, "on": True, "off": False, "1": True, "0": False})

    def size(v):
        return int(v) if v.isdigit() else _bad(v, ("a number of bytes",))

    parsers = {
        f.name: boolean for f in dataclasses.fields(s.QnnExecuTorchHtpBackendOptions) if f.name.startswith("use_")
    }
    parsers.pop("use_weight_sharing")
    parsers.update(
        precision=enum(s.QnnExecuTorchHtpPrecision),
        performance_mode=enum(s.QnnExecuTorchHtpPerformanceMode),
        pd_session=enum(s.QnnExecuTorchHtpPdSession),
        max_sf_buf_size=size,
    )
    return parsers


class _BadValue(ValueError):
    pass


def _bad(value, allowed):
    raise _BadValue(f"'{value}' (one of: {', '.join(map(str, allowed))})")


def parse_options(texts, methods) -> dict[str, dict]:
    """--qnn-option [METHOD:]KEY=VALUE -> {method: {htp option: value}} for every method."""
    parsers = _option_parsers()
    per_method = {m: {} for m in methods}
    for text in texts:
        scope, _, assignment = text.rpartition(":") if ":" in text.split("=", 1)[0] else ("", "", text)
        key, eq, value = assignment.partition("=")
        if not eq:
            raise InputError(f"--qnn-option '{text}' is not [METHOD:]KEY=VALUE")
        if key == "optimization_level":
            raise InputError(
                "--qnn-option optimization_level: ExecuTorch 1.5.1's QNN compile spec has no such field "
                f"(the backend chooses it); known keys: {', '.join(sorted(parsers))}"
            )
        if key not in parsers:
            raise InputError(f"--qnn-option: unknown key '{key}'; known keys: {', '.join(sorted(parsers))}")
        if scope and scope not in per_method:
            raise InputError(
                f"--qnn-option '{text}': this program has no method '{scope}'; its methods: {', '.join(methods)}"
            )
        try:
            parsed = parsers[key](value)
        except _BadValue as e:
            raise InputError(f"--qnn-option {key}: bad value {e}") from None
        for method in [scope] if scope else methods:
            per_method[method][key] = parsed
    return per_method


@dataclass(frozen=True)
class QnnPlan:
    """What the user asked for, checked: SoC, which methods share one context binary, each
    method's HTP options. Built before any work; the compile specs are made from it."""

    soc: str
    htp_arch: int
    methods: tuple[str, ...]
    groups: tuple[tuple[str, ...], ...]
    weight_sharing: bool
    shared_buffer: bool
    htp_options: dict  # method -> {option: value}


def plan(options: QnnOptions, methods) -> QnnPlan:
    """Refuses an unknown SoC, weight sharing on an HTP older than V73, bad --qnn-option values,
    and methods of one context binary whose options differ (QNN would silently use the first's)."""
    methods = tuple(methods)
    info = soc_info(options.soc)
    soc, arch = info.soc_model.name, _arch(info)
    multi = len(methods) > 1
    sharing = multi and options.weight_sharing and not options.x86_emulator
    if sharing and arch < WEIGHT_SHARING_MIN_ARCH:
        newer = ", ".join(n for n, i in sorted(soc_table().items()) if _arch(i) >= WEIGHT_SHARING_MIN_ARCH)
        raise InputError(
            f"SoC {soc} has HTP V{arch}, and {' and '.join(methods)} sharing weights in one context binary needs V73 or "
            f"newer ({newer}); export with --mode kv, or with --no-weight-sharing for one context binary per method"
        )
    per_method = parse_options(options.options, methods)
    groups = (methods,) if sharing else tuple((m,) for m in methods)
    for group in groups:
        first = per_method[group[0]]
        for other in group[1:]:
            differs = sorted(k for k in {*first, *per_method[other]} if first.get(k) != per_method[other].get(k))
            if differs:
                raise InputError(
                    f"methods {group[0]} and {other} share one context binary but their QNN options differ in "
                    f"{', '.join(differs)}; QNN compiles every method of a context binary with the first one's "
                    "options: drop the METHOD: prefix, or pass --no-weight-sharing for one context binary per method"
                )
    return QnnPlan(
        soc=soc,
        htp_arch=arch,
        methods=methods,
        groups=groups,
        weight_sharing=sharing,
        shared_buffer=multi and not options.x86_emulator,
        htp_options=per_method,
    )


def compile_specs(p: QnnPlan) -> dict[str, list]:
    """method -> ExecuTorch's QNN compile specs for it (generated by ExecuTorch's own helpers)."""
    no_download()
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
    )

    chipset = soc_info(p.soc).soc_model
    specs = {}
    for method in p.methods:
        backend = generate_htp_compiler_spec(use_fp16=False, use_weight_sharing=p.weight_sharing)
        for key, value in p.htp_options[method].items():
            setattr(backend.htp_options, key, value)
        specs[method] = generate_qnn_executorch_compiler_spec(chipset, backend, shared_buffer=p.shared_buffer)
    check_specs(specs, p)
    return specs


def decode(spec_bytes: bytes):
    no_download()
    from executorch.backends.qualcomm.serialization.qc_schema_serialize import flatbuffer_to_option

    return flatbuffer_to_option(spec_bytes)


def describe(spec_bytes: bytes) -> dict:
    """A QNN compile spec decoded, human-readable."""
    o = decode(spec_bytes)
    htp = o.backend_options.htp_options
    described = {
        "soc": o.soc_info.soc_model.name,
        "htp_arch": o.soc_info.htp_info.htp_arch.name,
        "vtcm_mb": o.soc_info.htp_info.vtcm_size_in_mb,
        "backend": str(o.backend_options.backend_type),
        "shared_buffer": o.shared_buffer,
    }
    if htp is not None:
        described.update(
            weight_sharing=htp.use_weight_sharing,
            precision=_snake(htp.precision.name, "kHtp"),
            performance_mode=_snake(htp.performance_mode.name, "kHtp"),
            pd_session=_snake(htp.pd_session.name, "kHtp"),
            multi_contexts=htp.use_multi_contexts,
            spill_fill_bytes=htp.max_sf_buf_size,
            **{k: getattr(htp, k) for k in ("use_conv_hmx", "use_dlbc", "use_fold_relu", "use_slc_allocator")},
        )
    return described


def spec_bytes(spec_list) -> bytes:
    found = [s.value for s in spec_list if s.key == SPEC_KEY]
    if len(found) != 1:
        raise ExportError(f"expected one '{SPEC_KEY}' compile spec, found {len(found)}")
    return bytes(found[0])


def check_specs(specs: dict, p: QnnPlan) -> None:
    """The seed's target validation: every method's specs decoded back and compared, as enums,
    with what was asked (SoC, HTP backend, arch, weight sharing); the methods of one context
    binary must carry identical specs, since QNN compiles them all with the first one's."""
    s = qc_schema()
    chipset = soc_info(p.soc).soc_model
    for method, spec_list in specs.items():
        o = decode(spec_bytes(spec_list))
        found = {
            "SoC": o.soc_info.soc_model,
            "backend": o.backend_options.backend_type,
            "HTP arch": o.soc_info.htp_info.htp_arch,
        }
        asked = {"SoC": chipset, "backend": s.QnnExecuTorchBackendType.kHtpBackend, "HTP arch": s.HtpArch(p.htp_arch)}
        for what in found:
            if found[what] != asked[what]:
                raise ExportError(
                    f"the QNN compile spec of {method} names {what} {found[what].name}, but {asked[what].name} was asked"
                )
        if o.backend_options.htp_options.use_weight_sharing != p.weight_sharing:
            raise ExportError(
                f"the QNN compile spec of {method} has weight sharing {'on' if not p.weight_sharing else 'off'}"
            )
    for group in p.groups:
        first = spec_bytes(specs[group[0]])
        for other in group[1:]:
            if spec_bytes(specs[other]) != first:
                raise ExportError(
                    f"methods {group[0]} and {other} share one QNN context binary but carry different compile "
                    f"specs ({describe(first)} vs {describe(spec_bytes(specs[other]))}); QNN would silently use {group[0]}'s"
                )


def _lowered(edge, p: QnnPlan) -> dict[str, list]:
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    return {
        m: [lowered for _, lowered, _ in get_lowered_submodules(edge.exported_program(m).graph_module)]
        for m in p.methods
        if m in edge.methods
    }


def size_spill_fill(edge, p: QnnPlan) -> int | None:
    """With use_multi_contexts and no max_sf_buf_size given, ExecuTorch's `update_spill_fill_size`
    reads every compiled context binary (through the SDK's libraries, so only with an SDK) and
    writes the largest spill-fill size into every delegate's spec: one buffer serves them all."""
    wanted = any(o.get("use_multi_contexts") and not o.get("max_sf_buf_size") for o in p.htp_options.values())
    if not wanted or sdk_root() is None:
        return None
    from executorch.backends.qualcomm.utils import utils

    return utils.update_spill_fill_size([d for ds in _lowered(edge, p).values() for d in ds])


def check_lowered(edge, p: QnnPlan) -> None:
    """After lowering (and spill-fill sizing): each method's delegates carry the asked specs
    (decoded), the methods of a group have as many delegates as each other, and a group's i-th
    delegates share one payload."""
    size_spill_fill(edge, p)
    delegates = _lowered(edge, p)
    check_specs(
        {f"{m} delegate {i}": d.compile_specs for m, ds in delegates.items() for i, d in enumerate(ds)},
        dataclasses.replace(p, groups=()),
    )
    for group in p.groups:
        counts = {m: len(delegates.get(m, ())) for m in group}
        if len(set(counts.values())) != 1:
            raise ExportError(
                f"the methods of one QNN context binary were split into different numbers of partitions: {counts}"
            )
        for i in range(counts[group[0]]):
            payloads = {bytes(delegates[m][i].processed_bytes) for m in group}
            if len(payloads) != 1:
                raise ExportError(f"{' and '.join(group)} did not get one shared context binary for partition {i}")
            if len({spec_bytes(delegates[m][i].compile_specs) for m in group}) != 1:
                raise ExportError(
                    f"the delegates of {' and '.join(group)}, partition {i}, carry different compile specs"
                )


def summary(p: QnnPlan) -> dict:
    """The manifest's `compile_spec`: decoded from the specs themselves; per-method differences listed."""
    specs = compile_specs(p)
    described = {m: describe(spec_bytes(specs[m])) for m in p.methods}
    common = described[p.methods[0]]
    result = {**common, "context_binaries": [list(g) for g in p.groups]}
    differing = {m: {k: v for k, v in d.items() if common.get(k) != v} for m, d in described.items()}
    if any(differing.values()):
        result["per_method"] = {m: d for m, d in differing.items() if d}
    return result
