"""What a backend module builds: a `Target` (a leaf: the backend modules build one each, the
package's __init__ collects them)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupedLowering:
    """For a backend whose one payload can hold several graphs (QNN context binaries): the methods
    of each group are handed to the backend together, in one `preprocess_multimethod` call, so
    they share one payload (and, in it, one copy of the weights); each group is partitioned with
    one compile-spec list, since the backend compiles a group with its first method's specs."""

    groups: tuple[tuple[str, ...], ...]  # methods lowered together
    compile_specs: dict  # method -> its list of ExecuTorch CompileSpec
    partitioner: Callable[[list], object]  # a CompileSpec list -> the backend's partitioner
    # Around partitioning and preprocessing, given {method: specs} (QNN: its QnnManager).
    context: Callable[[dict], contextlib.AbstractContextManager] = lambda specs: contextlib.nullcontext()
    export_transform: Callable = lambda program: program  # on each exported graph, before the edge dialect
    edge_passes: Callable = lambda program, specs: []  # on each edge graph, before partitioning
    check: Callable = lambda edge, specs: None  # validates the lowered programs (an EdgeProgramManager)


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    recipes: tuple[str, ...]  # quantization recipes this backend accepts
    partitioners: Callable[[], list]  # ExecuTorch partitioners; empty: no delegate
    embedding_recipes: tuple[str, ...] = ()
    # (QuantOptions, the exported quantize graph's module) -> a PT2E quantizer, for static recipes
    static_quantizer: Callable | None = None
    # Why programs cannot be lowered on this host (a missing vendor SDK), or None when they can.
    lowering_blocked: Callable[[], str | None] = lambda: None
    # Rewrites an eager graph module in place into the form this backend lowers best, right
    # before it is exported for lowering (calibrated QDQ graphs pass through unchanged); the
    # flag: the shapes of all the program's graphs are static (no dynamic sequence length).
    adapt_for_lowering: Callable[[object, bool], None] = lambda module, static_shapes: None
    # For a backend that lowers several methods into one payload (upstream.exir_lowering.lower_grouped): the
    # program's method names -> how they are grouped, partitioned and checked.
    grouped: Callable[[tuple[str, ...]], GroupedLowering] | None = None
    # The program's method names -> the backend's compile spec decoded for the manifest, or None.
    compile_spec: Callable[[tuple[str, ...]], dict | None] = lambda methods: None
    # Lowers the text decoder only in its cache-I/O form (models/decoder.py): QNN takes no custom
    # ops and no data-dependent position.
    cache_io: bool = False
