"""The size of ExecuTorch's threadpool (XNNPACK's and the custom kernels' threads) from Python.

The pinned wheel's `portable_lib` binds `_unsafe_reset_threadpool(n)` and nothing public: without
it the pool takes one thread per core, and `genai bench --threads`, the bench scripts and the test
workers (two processes on two cores, docs/decisions/0002) could not hold it to what they measure
with. On a wheel without the binding the pool keeps its size, with one warning.
tests/upstream/test_executorch_threadpool.py fails when the pinned wheel stops providing it.
"""

from __future__ import annotations

import logging

from genai_pipeline.upstream.executorch_runtime_import import import_executorch_runtime

log = logging.getLogger(__name__)


def set_threadpool_size(n: int) -> bool:
    """Size ExecuTorch's threadpool to `n` threads for this process; False when the wheel cannot."""
    import_executorch_runtime()
    from executorch.extension.pybindings import portable_lib

    reset = getattr(portable_lib, "_unsafe_reset_threadpool", None)
    if reset is None:
        log.warning("this ExecuTorch cannot size its threadpool from Python; it keeps one thread per core")
        return False
    reset(n)
    return True
