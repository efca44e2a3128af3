"""Qualcomm QNN (HTP). ExecuTorch's QnnQuantizer annotates, calibrates and converts on any host,
so quantization and its evaluation run here; lowering needs the QNN SDK's libraries
(libQnnHtp.so), which only Qualcomm distributes."""

import os
from pathlib import Path

from genai_pipeline.targets import Target

# QuantDtype names of ExecuTorch's Qualcomm quantizer, by our recipe names.
QUANT_DTYPES = {"16a8w": "use_16a8w", "16a4w": "use_16a4w", "16a4w_block": "use_16a4w_block", "8a8w": "use_8a8w"}


def _no_download() -> None:
    # Set but empty: ExecuTorch's Qualcomm package leaves the SDK to us instead of fetching one.
    os.environ.setdefault("QNN_SDK_ROOT", "")


def _static_quantizer(options, graph_module):
    _no_download()
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype

    quantizer = QnnQuantizer()
    quantizer.set_default_quant_config(getattr(QuantDtype, QUANT_DTYPES[options.recipe]), is_linear_per_channel=True)
    if options.recipe == "16a4w_block":
        linears = [n.name for n in graph_module.graph.nodes if n.op == "call_function" and "linear" in str(n.target)]
        quantizer.set_block_size_map({name: (1, options.block_size) for name in linears})
    return quantizer


def _lowering_blocked() -> str:
    root = os.environ.get("QNN_SDK_ROOT", "")
    if not (root and any(Path(root).glob("lib/*/libQnnHtp.so"))):
        return (
            "lowering to QNN needs the Qualcomm QNN SDK (QNN_SDK_ROOT pointing at a folder with "
            "lib/<arch>/libQnnHtp.so) and none is installed here; the calibrated QDQ model was saved and "
            "`genai eval` evaluates it"
        )
    # Building QNN compile specs and context binaries is the next step; without an SDK on any
    # machine of ours it cannot be tested, so it is refused rather than shipped untested.
    return f"QNN SDK found at {root}, but lowering to QNN is not supported by this version yet; the QDQ model was saved"


TARGET = Target(
    name="qnn",
    description="Qualcomm HTP (quantize and evaluate anywhere; lowering needs the QNN SDK)",
    recipes=tuple(QUANT_DTYPES),
    partitioners=list,
    static_quantizer=_static_quantizer,
    lowering_blocked=_lowering_blocked,
)
