"""Two internals of ExecuTorch's Qualcomm backend that have no public accessor.

- `soc_info_table()`: `qc_schema._soc_info_table`, the SoC -> chipset / HTP arch / VTCM table
  `--qnn-soc` is checked against (the schema imports no torch and needs no SDK).
- `qnn_pass_manager()`: `_passes.qnn_pass_manager.get_qnn_pass_manager_cls()()`, QNN's export and
  edge passes, run the way `to_edge_transform_and_lower_to_qnn` runs them.
On another ExecuTorch, where a name moved, one line naming the pinned version (an ExportError).
tests/upstream/test_qnn_internals.py fails when the pinned wheel stops providing them.
"""

from __future__ import annotations

import os

from genai_pipeline.errors import ExportError
from genai_pipeline.upstream import pins


def no_download() -> None:
    # Set but empty: ExecuTorch's Qualcomm package leaves the SDK to us instead of fetching one.
    os.environ.setdefault("QNN_SDK_ROOT", "")


def qc_schema():
    """ExecuTorch's Qualcomm compile-spec schema (public)."""
    no_download()
    from executorch.backends.qualcomm.serialization import qc_schema

    return qc_schema


def soc_info_table() -> dict:
    """SocModel -> SocInfo, as ExecuTorch's Qualcomm schema lists them."""
    table = getattr(qc_schema(), "_soc_info_table", None)
    if not isinstance(table, dict):
        raise ExportError(_moved("qc_schema._soc_info_table"))
    return table


def qnn_pass_manager():
    """A new QnnPassManager: `transform_for_export_pipeline`, `get_to_edge_transform_passes`."""
    no_download()
    try:
        from executorch.backends.qualcomm._passes.qnn_pass_manager import get_qnn_pass_manager_cls
    except ImportError:
        raise ExportError(_moved("_passes.qnn_pass_manager.get_qnn_pass_manager_cls")) from None
    return get_qnn_pass_manager_cls()()


def _moved(name: str) -> str:
    return (
        f"ExecuTorch's Qualcomm backend has no {name} here: this is written for "
        f"executorch=={pins.PINNED_EXECUTORCH} (found {pins.installed('executorch')}); install the version pyproject.toml pins"
    )
