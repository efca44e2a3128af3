"""Lowering to XNNPACK: what the delegate keeps together, and what lowering holds in memory."""

import functools
import gc

import pytest
import torch
from conftest import Q4, TINY_MAX_SEQ, TINY_PREFILL
from tqdm import tqdm

from genai_pipeline import compile
from genai_pipeline.compile import compile_artifacts, lower
from genai_pipeline.names import Mode
from genai_pipeline.options import PrepareOptions, QuantOptions
from genai_pipeline.prepare import prepare
from genai_pipeline.quantize import quantize
from genai_pipeline.registry import get_spec
from genai_pipeline.targets import get_target
from genai_pipeline.upstream import exir_lowering
from genai_pipeline.upstream.torch_export_caches import forget_lowered_graphs


@functools.cache  # each form lowered once per session: tests only read the programs
def lower_tiny(checkpoint, mode: str, verify_len: int = 0):
    """{method: lowered ExportedProgram} of the tiny model, as compile lowers it."""
    options = PrepareOptions(
        mode=mode, max_seq_len=TINY_MAX_SEQ, prefill_len=TINY_PREFILL, checkpoint=checkpoint, verify_len=verify_len
    )
    artifact = next(iter(prepare(get_spec("smollm2-135m"), options).artifacts.values()))
    with tqdm(disable=True) as progress:
        edge = lower(artifact, get_target("xnnpack"), progress)
    return {name.value: edge.exported_program(name.value) for name in artifact.graphs}, artifact.module.config


def delegates(program) -> list:
    return [
        getattr(program.graph_module, n.args[0].target)
        for n in program.graph.nodes
        if n.op == "call_function" and "executorch_call_delegate" in str(n.target)
    ]


def weight_names(program) -> set[str]:
    return {key for lowered in delegates(program) for key in lowered.named_data_store_output.pte_data}


def test_each_layer_is_one_delegate_call_and_methods_share_weight_bytes(tiny_checkpoint):
    methods, config = lower_tiny(tiny_checkpoint, Mode.HYBRID.value)
    for name, program in methods.items():
        left = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
        assert not [t for t in left if "mean" in t], (name, left)  # RMSNorm stays inside the delegate
        # one delegate per layer (attention input to the next layer's), plus the first and the head;
        # prefill (any length) too: its fused outputs' slices stay in (upstream/xnnpack_dynamic_slice.py)
        assert len(delegates(program)) <= config.n_layers + 2, (name, len(delegates(program)))
    assert weight_names(methods["prefill"]) == weight_names(methods["decode_token"])  # fused alike
    # Every weight the two methods share is one bytes object in memory while the program is built.
    by_key = {}
    for program in methods.values():
        for lowered in delegates(program):
            store = lowered.named_data_store_output
            for key, entry in store.pte_data.items():
                by_key.setdefault(key, []).append(store.buffers[entry.buffer_index])
    shared = [blobs for blobs in by_key.values() if len(blobs) > 1]
    # every linear of every layer is in both methods: wq+wk+wv and w1+w3 fused (Decoder.fuse_projections), wo, w2
    assert len(shared) >= 4 * config.n_layers
    assert all(all(b is blobs[0] for b in blobs) for blobs in shared)


def test_dynamic_length_graph_is_one_delegate_per_layer(tiny_checkpoint):
    """ExecuTorch's XNNPACK delegates no reshape to a symbolic size, nor (unpatched) a slice of a
    dynamic-length tensor: the dynamic `forward` reshapes with -1, and the slices of its fused
    projections' outputs and of RoPE's halves stay in (upstream/xnnpack_dynamic_slice.py), so each
    layer is one delegate call, as in hybrid (docs/decisions/0019, 0025)."""
    methods, config = lower_tiny(tiny_checkpoint, Mode.DYNAMIC.value)
    program = methods["forward"]
    assert len(delegates(program)) <= config.n_layers + 2
    left = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert not [t for t in left if "view_copy" in t], left
    # projections fused as in hybrid programs: the same weight bytes as a hybrid `decode_token`
    assert weight_names(program) == weight_names(lower_tiny(tiny_checkpoint, Mode.HYBRID.value)[0]["decode_token"])


@pytest.mark.parametrize("slices_delegated", [True, False])
def test_rope_swaps_halves_by_a_matmul_only_where_slices_would_end_the_delegate(
    tiny_eager, monkeypatch, slices_delegated
):
    """With the pinned ExecuTorch, RoPE's halves are slices (the +-1 product, the last matmul before
    the attention, slowed custom_sdpa at 2 threads: docs/decisions/0027); with another, whose
    partitioner takes no slice of a dynamic-length tensor, the product keeps each layer in one
    delegate and the projections stay unfused."""
    from genai_pipeline.targets import xnnpack

    if not slices_delegated:
        monkeypatch.setattr(xnnpack, "delegate_dynamic_slices", lambda: False)
    else:
        assert xnnpack.delegate_dynamic_slices()  # the pinned wheel
    decoder = tiny_eager()
    xnnpack.adapt_for_lowering(decoder, static_shapes=False)
    assert (decoder.rope_swap is None) == slices_delegated
    assert (decoder.layers[0].attention.fused is not None) == slices_delegated


def test_verify_of_any_length_beside_static_methods_takes_the_same_weights(tiny_checkpoint):
    """A hybrid program's `verify` (any length up to its own) is lowered in the static methods'
    form: fused in one and not the other, its weights would be other bytes than `decode_token`'s, stored
    and packed twice (the lookahead program of the real SmolLM2-135M once grew from 98 to 139 MB)."""
    methods, _ = lower_tiny(tiny_checkpoint, Mode.HYBRID.value, verify_len=4)
    assert {"prefill", "prefill_chunk", "decode_token", "verify"} <= set(methods)
    assert weight_names(methods["verify"]) == weight_names(methods["decode_token"])


def lower_quantized_tiny(checkpoint) -> tuple[bytes, int]:
    """The tiny model, dynamic mode, 8da4w, lowered as compile lowers it: (the program's bytes, how
    many times lowering re-traced a graph to decompose it)."""
    from torch.export import ExportedProgram

    options = PrepareOptions(
        mode=Mode.DYNAMIC.value, max_seq_len=TINY_MAX_SEQ, prefill_len=TINY_PREFILL, checkpoint=checkpoint
    )
    prepared = quantize(
        prepare(get_spec("smollm2-135m"), options), QuantOptions(recipe="8da4w", embedding=None), get_target("xnnpack")
    )
    get_target("xnnpack").partitioners()  # builds (and decomposes) XNNPACK's pattern graphs, once per process
    decompositions, run = [], ExportedProgram.run_decompositions
    with pytest.MonkeyPatch.context() as patch, tqdm(disable=True) as progress:
        patch.setattr(ExportedProgram, "run_decompositions", lambda *a, **k: decompositions.append(1) or run(*a, **k))
        program = compile.to_executorch(
            next(iter(prepared.artifacts.values())), get_target("xnnpack"), progress, quantized=True
        )
    forget_lowered_graphs()
    return program.buffer, len(decompositions)


def test_lowering_makes_the_program_executorchs_own_lowering_makes(tiny_checkpoint, monkeypatch):
    """compile decomposes each graph once (ExecuTorch: three times), and skips the aten-to-edge
    passes with nothing to rewrite in the graph and XNNPACK's preprocess passes with nothing to
    rewrite in a partition; the program is byte for byte ExecuTorch's."""
    from executorch.backends.xnnpack import _passes, xnnpack_preprocess
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    from genai_pipeline.upstream import xnnpack_preprocess as patches

    assert patches.install()
    ran, to_edge = [], []
    may_change, may_rewrite = patches._may_change, exir_lowering.may_rewrite
    monkeypatch.setattr(patches, "_may_change", lambda p, *a: ran.append((p.__name__, may_change(p, *a))) or ran[-1][1])
    monkeypatch.setattr(
        exir_lowering,
        "may_rewrite",
        lambda p, g: to_edge.append((exir_lowering.pass_name(p), may_rewrite(p, g))) or to_edge[-1][1],
    )
    ours, decompositions = lower_quantized_tiny(tiny_checkpoint)
    assert decompositions == 1  # one graph: the forward method
    skipped = {name for name, ran_it in to_edge if not ran_it}
    assert skipped == {
        "NormalizeTransposePass",
        "ReplaceBrokenOpsWithFunctionalOpsPass",
        "ScalarToTensorPass",
        "SymToTensorPass",
        "RemoveMixedTypeOperators",
        "MemoryFormatOpsPass",
    }
    assert {name for name, ran_it in to_edge if ran_it} >= {"ReplaceViewOpsWithViewCopyOpsPass", "OpReplacePass"}
    skipped = {name for name, ran_it in ran if not ran_it}
    assert {
        "ConvertToUpsampleBilinear2d",
        "ConvertToSDPAPass",
        "DecomposeBatchNorm",
        "Conv1dUnsqueezePass",
        "ConvertToLinearPass",
        "DimOrderOpsRevertPass",
    } <= skipped  # no dim-order op: the aten-to-edge pass that makes them was skipped too
    assert {name for name, ran_it in ran if ran_it} >= {"ChannelsLastTaggedReshapePass", "ConstPropPass"}

    monkeypatch.setattr(xnnpack_preprocess, "XNNPACKPassManager", _passes.XNNPACKPassManager)
    monkeypatch.setattr(
        compile,
        "to_edge_transform_and_lower",
        lambda programs, partitioners, constant_methods: to_edge_transform_and_lower(
            programs,
            partitioner=partitioners,
            constant_methods=constant_methods,
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
        ),
    )
    theirs, decompositions = lower_quantized_tiny(tiny_checkpoint)
    assert xnnpack_preprocess.XNNPACKPassManager is _passes.XNNPACKPassManager  # lowered with ExecuTorch's own
    assert decompositions == 3
    assert ours == theirs


def test_nothing_keeps_the_weights_once_the_program_is_written(tiny_checkpoint, tmp_path):
    """torch and ExecuTorch keep the last lowered graphs reachable from module globals, and with
    them the weights their nodes' metadata holds (as tensors of their own over the same memory);
    compile lets go of them (without the clean-up every weight stays reachable)."""

    def storages(tensors) -> set[int]:
        out = set()
        for t in tensors:
            inner = [getattr(t, n) for n in t.__tensor_flatten__()[0]] if hasattr(t, "__tensor_flatten__") else [t]
            out |= {i.untyped_storage().data_ptr() for i in inner if i.device.type == "cpu" and i.numel() > 1024}
        return out

    options = PrepareOptions(mode=Mode.DYNAMIC.value, max_seq_len=TINY_MAX_SEQ, checkpoint=tiny_checkpoint)
    prepared = quantize(prepare(get_spec("smollm2-135m"), options), Q4, get_target("xnnpack"))
    weights = storages(next(iter(prepared.artifacts.values())).module.state_dict().values())
    assert len(weights) >= 14  # 7 quantized linears x 2 layers, the embedding, the head
    compile_artifacts(prepared, get_target("xnnpack"), tmp_path)
    del prepared
    gc.collect()
    live = [
        o for o in gc.get_objects() if isinstance(o, torch.Tensor) and not isinstance(o, torch._subclasses.FakeTensor)
    ]
    assert not storages(live) & weights
