"""XNNPACK's preprocess (the step of lowering that serializes each partition for the delegate),
holding less memory and re-tracing less.

Upstream (executorch 1.5.1): before `preprocess`, `BackendDetails.copy_exported_program_for_preprocess`
deep-copies each partition, its weights included, and the default `preprocess_multimethod` keeps every
method's serialized partitions, each with its own bytes of every weight, until the program is
written; XNNPACK's configs keep the last node they refused (and with it a graph and its weights); and
`xnnpack_preprocess.preprocess` runs every pass of `XNNPACKPassManager` on every partition, each a
re-trace of the whole partition with fake tensors, whether or not it has anything to rewrite.
What we change: `install()` replaces the two hooks ExecuTorch gives backends to override
(`copy_exported_program_for_preprocess`: the graph is copied, the weights shared;
`preprocess_multimethod`: one bytes object per named weight, memory-mapped weights' pages given
back once serialized, refused nodes forgotten), points the name `preprocess` looks its pass manager up by at a
subclass skipping the passes with nothing to rewrite, and installs xnnpack_dynamic_slice's patch.
Why: lowering stays within ~2x the weights in memory, and the preprocess passes (~45 % of lowering a
decoder with a symbolic length) run only where they apply; the program is byte for byte the same
(tests/targets/test_xnnpack.py: ExecuTorch's own lowering against ours).
What breaks if upstream changes: the hooks' signatures, the module attribute `XNNPACKPassManager`,
`XNNPACKPassManager.transform`/`passes`/`exported_program`, the configs' `why.node`, the pass classes
named in `_ops_rewritten_by`, and the `data_store_output` of a preprocess result.
tests/upstream/test_xnnpack_preprocess.py fails when the pinned wheel stops having them. Another
version than the pinned one installs nothing (ExecuTorch's own preprocess, with a warning).
"""

import copy
import functools
import logging

from genai_pipeline.heap import page_out
from genai_pipeline.upstream import pins
from genai_pipeline.upstream.xnnpack_dynamic_slice import delegate_dynamic_slices

log = logging.getLogger(__name__)


def _copy_sharing_weights(cls, program, compile_specs):
    """The hook ExecuTorch calls to isolate each partition before `preprocess`, minus the weights.
    Its default deep-copies the partition's weights too, and holds the copies of every partition
    of every method at once: two extra copies of a hybrid program's weights. XNNPACK's preprocess
    replaces constants, never writes into them, so sharing them is safe."""
    weights = (*program.state_dict.values(), *program.constants.values())
    return copy.deepcopy(program, memo={id(w): w for w in weights})


def _forget_refused_nodes() -> None:
    """XNNPACK's partitioner configs keep the last node they refused (for a debug message), and
    with it that node's graph and the weights its metadata holds, for the life of the process.
    Partitioning is over when preprocess starts."""
    from executorch.backends.xnnpack.partition.config import (
        gemm_configs,
        generic_node_configs,
        node_configs,
        xnnpack_config,
    )

    for config in (gemm_configs, generic_node_configs, node_configs, xnnpack_config):
        config.why.node = None


def _preprocess_sharing_data(cls, programs, compile_specs):
    """ExecuTorch's default `preprocess_multimethod`, holding one bytes object per named weight:
    each method serializes its partitions on its own, so every weight the methods share would
    otherwise sit in memory once per method until the program is written. XNNPACK names weights
    by the SHA-256 of their bytes, so one name is one content."""
    _forget_refused_nodes()
    results, by_name = {}, {}
    for method, partitions in programs.items():
        results[method] = []
        for partition, specs in zip(partitions, compile_specs[method]):
            result = cls.preprocess(partition, specs)
            page_out(partition.state_dict.values())
            store = result.data_store_output  # deduplicated now, before the next partition adds its own
            for name, entry in (store.pte_data if store is not None else {}).items():
                store.buffers[entry.buffer_index] = by_name.setdefault(name, store.buffers[entry.buffer_index])
            results[method].append(result)
    return results


def _op_name(target) -> str:
    return getattr(target, "__name__", str(target))  # "aten.cat.default" for an edge op


def _ops_rewritten_by() -> dict[str, list[set[str]]]:
    """{pass class name: op sets}, for the passes of XNNPACK's preprocess that rewrite only certain
    ops (a single op, or one of the patterns they match): such a pass can change a partition only
    if the partition holds every op of one of its sets."""
    from executorch.backends.xnnpack._passes import DecomposeBatchNorm, FuseActivationPass
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa
    from executorch.exir.passes.dim_order_ops_registry import MemoryFormatOpsMap

    def patterns(graphs) -> list[set[str]]:
        return [{_op_name(n.target) for n in g.graph.nodes if n.op == "call_function"} for g in graphs]

    def each(*ops) -> list[set[str]]:
        return [{_op_name(op)} for op in ops]

    return {
        "ConvertToUpsampleBilinear2d": patterns(bilinear_2d.get_graphs()),
        "ConvertToSDPAPass": patterns(sdpa.get_graphs()),
        "ConvertToLinearPass": each("aten.mm.default", "aten.addmm.default", "aten.bmm.default"),
        "FuseBatchNormPass": each(*DecomposeBatchNorm.BATCH_NORM_OPS),
        "DecomposeBatchNorm": each(*DecomposeBatchNorm.BATCH_NORM_OPS),
        "FuseActivationPass": each(*FuseActivationPass.FUSEABLE_ACTIVATIONS),
        "DecomposeConcatenate": each("aten.cat.default"),
        "RemoveGetItemPass": each("aten.max_pool2d_with_indices.default", "aten.max.dim"),
        "Conv1dUnsqueezePass": each("aten.convolution.default"),
        "PReLUReshapePass": each("aten._prelu_kernel.default"),
        "RemoveRedundantCopyPass": each("aten._to_copy.default"),
        "DimOrderOpsRevertPass": each(*map(_op_name, MemoryFormatOpsMap)),
    }


def _may_change(pass_, graph, rewrites: dict[str, list[set[str]]]) -> bool:
    """False for a pass that has nothing to rewrite in `graph`."""
    if pass_.__name__ == "PropagateCustomMetaPass":  # copies node.meta["custom"] to q/dq nodes
        return any("custom" in n.meta for n in graph.nodes)
    if pass_.__name__ not in rewrites:
        return True
    present = {_op_name(n.target) for n in graph.nodes if n.op == "call_function"}
    return any(ops <= present for ops in rewrites[pass_.__name__])


@functools.cache
def _pass_manager_skipping_idle_passes():
    """XNNPACK's preprocess pass manager, minus the passes with nothing to rewrite in a partition.
    Each pass re-traces the whole partition with fake tensors even when it changes nothing; with a
    symbolic sequence length the passes are ~45 % of lowering a decoder, and 11 of the 17 never
    apply to one (batch norm, convolutions, upsampling, ...). Whether a pass applies is decided on
    the graph as the passes before it left it: they add ops (e.g. `_to_copy`) later ones rewrite."""
    from executorch.backends.xnnpack._passes import XNNPACKPass, XNNPACKPassManager
    from executorch.exir.pass_base import ExportPass
    from executorch.exir.program._program import _transform

    rewrites = _ops_rewritten_by()

    class PassManager(XNNPACKPassManager):
        def transform(self):
            program = self.exported_program
            for pass_ in self.passes:
                if not _may_change(pass_, program.graph, rewrites):
                    continue
                assert issubclass(pass_, ExportPass), pass_  # what XNNPACKPassManager accepts
                program = _transform(program, pass_(program) if issubclass(pass_, XNNPACKPass) else pass_())
            return program

    return PassManager


_installed: bool | None = None  # install()'s answer, once per process


def install() -> bool:
    """Installs the patches above into ExecuTorch's XNNPACK backend, once per process (a second call
    changes nothing); True when installed, False for an ExecuTorch other than the pinned one (its
    own preprocess, logged once). Call it before lowering to XNNPACK."""
    global _installed
    if _installed is None:
        _installed = (
            pins.warn_unpinned(
                log, "XNNPACK's preprocess left as ExecuTorch's (more memory, slower lowering)", "executorch"
            )
            and _patch()
        )
    return _installed


def _patch() -> bool:
    from executorch.backends.xnnpack import xnnpack_preprocess
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    # Both are hooks ExecuTorch gives backends to override; these keep lowering within ~2x the weights.
    XnnpackBackend.copy_exported_program_for_preprocess = classmethod(_copy_sharing_weights)
    XnnpackBackend.preprocess_multimethod = classmethod(_preprocess_sharing_data)
    # Not a hook: the name `preprocess` looks up when it runs its passes (output byte-identical).
    xnnpack_preprocess.XNNPACKPassManager = _pass_manager_skipping_idle_passes()
    delegate_dynamic_slices()  # patches XNNPACK's slice config and serializer (see there)
    return True
