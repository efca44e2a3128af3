"""upstream/executorch_threadpool.py: the pinned wheel binds `_unsafe_reset_threadpool`, and without
it the pool keeps its size with a warning instead of failing."""

import logging

from genai_pipeline.upstream import executorch_threadpool
from genai_pipeline.upstream.executorch_runtime_import import import_executorch_runtime


def test_the_pinned_wheel_sizes_its_threadpool():
    import_executorch_runtime()
    from executorch.extension.pybindings import portable_lib

    assert callable(portable_lib._unsafe_reset_threadpool)
    assert executorch_threadpool.set_threadpool_size(1) is True


def test_without_the_binding_the_pool_keeps_its_size(monkeypatch, caplog):
    import_executorch_runtime()
    from executorch.extension.pybindings import portable_lib

    monkeypatch.delattr(portable_lib, "_unsafe_reset_threadpool")
    with caplog.at_level(logging.WARNING, logger=executorch_threadpool.__name__):
        assert executorch_threadpool.set_threadpool_size(1) is False
    assert "cannot size its threadpool" in caplog.text
