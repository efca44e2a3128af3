"""upstream/xnnpack_preprocess.py: XNNPACK's preprocess holding less memory and re-tracing less. The
upstream names and signatures it relies on in the pinned wheel, `install()` applied once, and what
each patch does. (That the programs stay byte for byte ExecuTorch's is
tests/targets/test_xnnpack.py::test_lowering_makes_the_program_executorchs_own_lowering_makes.)"""

import dataclasses
import inspect
import logging

import torch
from pretend_installed import pretend_installed

from genai_pipeline.targets import get_target
from genai_pipeline.upstream import xnnpack_preprocess as patches


def test_the_hooks_and_names_it_replaces_are_the_pinned_wheels():
    from executorch.backends.xnnpack import xnnpack_preprocess
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.backends.xnnpack.partition.config import (
        gemm_configs,
        generic_node_configs,
        node_configs,
        xnnpack_config,
    )
    from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult

    # The two hooks ExecuTorch gives a backend to override, with the arguments ours take.
    copy_hook, multimethod_hook = (
        inspect.getattr_static(BackendDetails, name)
        for name in ("copy_exported_program_for_preprocess", "preprocess_multimethod")
    )
    assert isinstance(copy_hook, classmethod) and isinstance(multimethod_hook, classmethod)
    assert list(inspect.signature(copy_hook.__func__).parameters) == ["cls", "edge_program", "compile_specs"]
    assert list(inspect.signature(multimethod_hook.__func__).parameters) == ["cls", "edge_programs", "compile_specs"]
    assert "data_store_output" in {f.name for f in dataclasses.fields(PreprocessResult)}
    # `preprocess` looks its pass manager up by the module-level name install() replaces.
    assert "XNNPACKPassManager" in xnnpack_preprocess.XnnpackBackend.preprocess.__code__.co_names
    assert xnnpack_preprocess.XNNPACKPassManager.__mro__[-2:] == (XNNPACKPassManager, object)
    # What the skipping PassManager reads of XNNPACK's own: its passes and its program.
    manager = XNNPACKPassManager(None)
    assert isinstance(manager.passes, list) and hasattr(XNNPACKPassManager, "exported_program")
    # Every pass the skip table names is one XNNPACK's preprocess runs (a renamed pass would just always run).
    assert set(patches._ops_rewritten_by()) <= {p.__name__ for p in manager.passes}
    for config in (gemm_configs, generic_node_configs, node_configs, xnnpack_config):
        assert hasattr(config.why, "node")  # the refused node _forget_refused_nodes lets go of


def test_install_applies_the_patches_once():
    from executorch.backends.xnnpack import xnnpack_preprocess
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    assert patches.install() and patches.install()
    get_target("xnnpack").partitioners()  # installs nothing more
    assert XnnpackBackend.preprocess_multimethod.__func__ is patches._preprocess_sharing_data
    assert XnnpackBackend.copy_exported_program_for_preprocess.__func__ is patches._copy_sharing_weights
    # One subclass of XNNPACK's own pass manager, not a subclass of a subclass.
    assert xnnpack_preprocess.XNNPACKPassManager is patches._pass_manager_skipping_idle_passes()
    assert xnnpack_preprocess.XNNPACKPassManager.__bases__ == (XNNPACKPassManager,)


def test_another_executorch_installs_nothing(monkeypatch, caplog):
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    before = XnnpackBackend.__dict__.get("preprocess_multimethod")
    monkeypatch.setattr(patches, "_installed", None)
    pretend_installed(monkeypatch, executorch="0.0.0")
    with caplog.at_level(logging.WARNING, logger=patches.log.name):
        assert patches.install() is False
    assert XnnpackBackend.__dict__.get("preprocess_multimethod") is before
    assert "executorch 0.0.0 (pinned: 1.5.1)" in caplog.text


def test_partition_copied_for_preprocess_shares_its_weights(tiny_eager):
    """ExecuTorch's default copy holds every weight twice more while a hybrid program is lowered;
    ours copies the graph only (XNNPACK's preprocess never writes into a weight: the programs'
    parity with the eager model in test_compile.py would show it if it did)."""
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
    from executorch.exir.backend.backend_details import BackendDetails

    patches.install()
    program = torch.export.export(tiny_eager(), (torch.zeros(1, 2, dtype=torch.long), torch.tensor([0])), strict=False)
    ours = XnnpackBackend.copy_exported_program_for_preprocess(program, [])
    default = BackendDetails.copy_exported_program_for_preprocess.__func__(XnnpackBackend, program, [])
    assert ours.graph_module is not program.graph_module
    assert all(ours.state_dict[k] is v for k, v in program.state_dict.items())
    assert all(default.state_dict[k] is not v for k, v in program.state_dict.items())


def test_a_pass_runs_when_its_ops_are_there():
    from executorch.backends.xnnpack._passes import (
        ConstPropPass,
        Conv1dUnsqueezePass,
        FuseActivationPass,
        PropagateCustomMetaPass,
        RemoveRedundantCopyPass,
    )
    from executorch.exir.dialects._ops import ops as exir_ops
    from executorch.exir.passes.memory_format_ops_pass import DimOrderOpsRevertPass

    rewrites = patches._ops_rewritten_by()
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(exir_ops.edge.aten._to_copy.default, (x,))
    graph.output(graph.call_function(exir_ops.edge.aten.relu.default, (y,)))
    assert patches._may_change(RemoveRedundantCopyPass, graph, rewrites)
    assert patches._may_change(FuseActivationPass, graph, rewrites)
    assert patches._may_change(ConstPropPass, graph, rewrites)  # not in the table: always runs
    assert not patches._may_change(Conv1dUnsqueezePass, graph, rewrites)
    assert not patches._may_change(PropagateCustomMetaPass, graph, rewrites)
    y.meta["custom"] = {"tag": 1}
    assert patches._may_change(PropagateCustomMetaPass, graph, rewrites)
    assert not patches._may_change(DimOrderOpsRevertPass, graph, rewrites)
    y.target = exir_ops.edge.dim_order_ops._to_dim_order_copy.default
    assert patches._may_change(DimOrderOpsRevertPass, graph, rewrites)
