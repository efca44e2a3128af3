"""upstream/torch_export_caches.py: the caches torch's export and ExecuTorch's lowering keep at module
or class level exist in the pinned wheels under the names it clears, and are empty afterwards. (That
clearing them lets an export's weights go is
tests/targets/test_xnnpack.py::test_nothing_keeps_the_weights_once_the_program_is_written.)"""

import logging

import torch
from pretend_installed import pretend_installed
from torch.export import Dim

from genai_pipeline.upstream import torch_export_caches


def _export_a_dynamic_graph():
    torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),), dynamic_shapes=({0: Dim("n")},), strict=False)


def test_the_caches_it_clears_are_the_pinned_wheels():
    from executorch.exir.backend.utils import is_same_node
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental import proxy_tensor
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    assert isinstance(proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT, dict)
    assert callable(FakeTensorMode.cache_clear) and callable(is_same_node.cache_clear)
    assert isinstance(ShapeEnv().fake_tensor_cache, dict)
    assert any(hasattr(method, "cache_clear") for method in vars(ShapeEnv).values())


def test_an_export_fills_them_and_forgetting_empties_them():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental import proxy_tensor

    _export_a_dynamic_graph()
    assert FakeTensorMode.cache_info().size and proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT
    torch_export_caches.forget_lowered_graphs()
    assert not FakeTensorMode.cache_info().size and not proxy_tensor._FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT


def test_another_torch_clears_nothing(monkeypatch, caplog):
    from torch._subclasses.fake_tensor import FakeTensorMode

    _export_a_dynamic_graph()
    pretend_installed(monkeypatch, torch="0.0.0")
    with caplog.at_level(logging.WARNING, logger=torch_export_caches.log.name):
        torch_export_caches.forget_lowered_graphs()
    assert FakeTensorMode.cache_info().size
    assert "torch 0.0.0 (pinned: 2.13.0)" in caplog.text
