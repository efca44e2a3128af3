"""upstream/qnn_internals.py: the pinned wheel's Qualcomm schema lists the SoCs and its pass manager
has the two passes lowering runs; where a name moved, one line names the pinned version."""

import pytest

from genai_pipeline.errors import ExportError
from genai_pipeline.upstream import qnn_internals


def test_the_soc_table_lists_snapdragons_with_their_htp_arch():
    table = {info.soc_model.name: info for info in qnn_internals.soc_info_table().values()}
    assert {"SM8650", "SM8450"} <= set(table)
    assert int(table["SM8650"].htp_info.htp_arch) == 75 and int(table["SM8450"].htp_info.htp_arch) == 69


def test_the_pass_manager_runs_the_export_and_edge_passes():
    manager = qnn_internals.qnn_pass_manager()
    assert callable(manager.transform_for_export_pipeline) and callable(manager.get_to_edge_transform_passes)


def test_a_moved_table_is_one_line_naming_the_pinned_version(monkeypatch):
    monkeypatch.delattr(qnn_internals.qc_schema(), "_soc_info_table")
    with pytest.raises(ExportError, match="written for executorch==1.5.1"):
        qnn_internals.soc_info_table()
