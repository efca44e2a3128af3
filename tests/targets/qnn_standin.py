"""A stand-in for ExecuTorch's QNN backend, for hosts without the QNN SDK (tests only).

It has what the multi-graph layout depends on: a partitioner handing the backend whole graphs
with the real QNN compile specs, and a `preprocess_multimethod` that, like QNN's, needs equal
partition counts per method and returns, for partition i, ONE payload holding every method's
i-th graph and each weight once (QNN: one context binary with weight sharing). The payload is
a JSON header (graphs by method name, the compile spec, weight index) + the unique weights."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import struct

import torch
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.partitioner import DelegationSpec, Partitioner, PartitionResult
from executorch.exir.backend.utils import tag_constant_data

from genai_pipeline.options import QnnOptions
from genai_pipeline.targets import qnn, qnn_specs

MAGIC = b"STANDINQNN"


def _weights(program) -> dict[str, torch.Tensor]:
    """The constants a partition's graph reads: parameters, buffers, lifted constants."""
    sig = program.graph_signature
    names = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    found = {}
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in names:
            target = names[node.name]
            found[target] = program.state_dict[target] if target in program.state_dict else program.constants[target]
    return found


def serialise(graphs: dict, spec: bytes) -> bytes:
    """One payload: every method's graph, the compile spec, each distinct weight once."""
    blobs, index, layout = [], {}, {}
    for method, program in graphs.items():
        layout[method] = {"graph": program.graph_module.code, "weights": {}}
        for name, tensor in _weights(program).items():
            data = tensor.detach().contiguous().numpy().tobytes()
            digest = hashlib.sha256(data).hexdigest()
            if digest not in index:
                index[digest] = (sum(len(b) for b in blobs), len(data))
                blobs.append(data)
            layout[method]["weights"][name] = digest
    header = json.dumps({"methods": layout, "weights": index, "compile_spec": spec.hex()}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + b"".join(blobs)


def parse(payload: bytes) -> tuple[dict, bytes]:
    assert payload.startswith(MAGIC)
    (size,) = struct.unpack_from("<I", payload, len(MAGIC))
    start = len(MAGIC) + 4
    return json.loads(payload[start : start + size]), payload[start + size :]


class StandInQnnBackend(BackendDetails):
    """Registered process-wide by its class name: the name must be unique."""

    calls: list[dict[str, int]] = []  # per preprocess_multimethod call: method -> partitions
    programs: list[dict[str, list]] = []  # per call: method -> the partitions' edge programs, as QNN gets them

    @staticmethod
    def preprocess(edge_program, compile_specs):
        return PreprocessResult(
            processed_bytes=serialise({"forward": edge_program}, qnn_specs.spec_bytes(compile_specs))
        )

    @staticmethod
    def preprocess_multimethod(edge_programs, compile_specs):
        StandInQnnBackend.calls.append({method: len(programs) for method, programs in edge_programs.items()})
        StandInQnnBackend.programs.append(dict(edge_programs))
        counts = {len(programs) for programs in edge_programs.values()}
        assert len(counts) == 1, "Only graphs with the same number of partitions could be used"  # as QNN's
        first = next(iter(compile_specs.values()))  # QNN compiles every method with the first one's specs
        results = {method: [] for method in edge_programs}
        for i in range(counts.pop()):
            payload = serialise(
                {m: programs[i] for m, programs in edge_programs.items()}, qnn_specs.spec_bytes(first[i])
            )
            for method in edge_programs:
                results[method].append(PreprocessResult(processed_bytes=payload))
        return results


class StandInPartitioner(Partitioner):
    """Takes every operator of a graph (one partition per method), and the weights with it."""

    def __init__(self, compile_specs: list):
        super().__init__()
        self.delegation_spec = DelegationSpec(StandInQnnBackend.__name__, compile_specs)

    def partition(self, program) -> PartitionResult:
        for node in program.graph_module.graph.nodes:
            if node.op == "call_function":
                node.meta["delegation_tag"] = "standin_0"
        tag_constant_data(program)
        return PartitionResult(tagged_exported_program=program, partition_tags={"standin_0": self.delegation_spec})


def standin_target(options: QnnOptions = QnnOptions()):
    """The QNN target as configured for a user, with only the partitioner (and the QnnManager
    context, which needs the SDK) replaced: spec building, QNN's export and edge passes, the
    grouping and the checks after lowering are the real ones."""
    target = qnn.configure(options)
    real = target.grouped

    def grouped(methods):
        return dataclasses.replace(
            real(methods), partitioner=StandInPartitioner, context=lambda specs: contextlib.nullcontext()
        )

    return dataclasses.replace(target, grouped=grouped, lowering_blocked=lambda: None)
