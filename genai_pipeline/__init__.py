"""GenAI Pipeline: from an LLM checkpoint to verified ExecuTorch programs.

The Python API, the CLI's commands as functions (README.md, "Python API"):

    export(model, out=DIR, checkpoint=..., prepare=PrepareOptions(...), quant=QuantOptions(...),
           target="xnnpack") -> ArtifactSet                  genai export
    open_session(folder) -> a Session, for any export         genai run (with generate, Sampler, Tokenizer)
    evaluate(folder, EvalOptions(text=FILE)) -> dict           genai eval --text

and the option classes of options.py. `import genai_pipeline` loads no torch: the options are
imported here, the rest on first use.
"""

import importlib as _importlib
import sys as _sys
import types as _types

from genai_pipeline.options import (  # torch-free
    BenchOptions,
    CalibrationOptions,
    DatasetSpec,
    EvalOptions,
    ImageEvalOptions,
    PrepareOptions,
    QnnOptions,
    QuantOptions,
    SamplingOptions,
)

__version__ = "0.2.0"

# name -> the module it comes from, imported on first use (they import torch)
_LAZY = {
    "export": "genai_pipeline.export",
    "open_session": "genai_pipeline.runtime.open",
    "Session": "genai_pipeline.runtime.session",
    "generate": "genai_pipeline.runtime.generate",
    "Sampler": "genai_pipeline.runtime.generate",
    "Tokenizer": "genai_pipeline.tokenizer",
    "evaluate": "genai_pipeline.evaluate",
}

__all__ = [
    "BenchOptions",
    "CalibrationOptions",
    "DatasetSpec",
    "EvalOptions",
    "ImageEvalOptions",
    "PrepareOptions",
    "QnnOptions",
    "QuantOptions",
    "SamplingOptions",
    *_LAZY,
    "__version__",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


class _Package(_types.ModuleType):
    """`export` and `evaluate` are both a function and the module defining it. Once a submodule is
    imported, the import system sets it on its package; here the function of the same name is set
    instead, so that `genai_pipeline.export(...)` stays a call however the module was first imported
    (its other names: `from genai_pipeline.export import ...`)."""

    def __setattr__(self, name: str, value) -> None:
        if name in _LAZY and isinstance(value, _types.ModuleType):
            value = getattr(value, name, value)
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
