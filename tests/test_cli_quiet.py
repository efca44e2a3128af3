"""A quiet, quick CLI: no torch to build the parser, every option's help and default shown, and
ExecuTorch's C++ log lines off the terminal unless GENAI_DEBUG=1."""

import argparse
import dataclasses
import os
import re
import subprocess
import sys

from genai_pipeline.cli import _default, build_parser

NATIVE_LOG = re.compile(r"^\[[\w.]+:\d+\]", re.M)  # e.g. "[cpuinfo_utils.cpp:71] Reading file ..."


def _subparsers(parser):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_the_parser_imports_no_torch():
    code = ("import sys; from genai_pipeline.cli import build_parser; build_parser(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'executorch', 'torchao', 'numpy', 'transformers'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "genai_pipeline.cli", "export", "--help"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and "--out" in result.stdout
    assert not re.search(r"\|\s+torch$", result.stderr, re.M)


def test_every_option_has_help_and_shows_its_default():
    for name, sub in _subparsers(build_parser()).items():
        text = sub.format_help()
        for action in sub._actions:
            assert action.help, f"genai {name} {action.dest} has no help"
            if action.option_strings and action.default not in (None, [], argparse.SUPPRESS) and not action.required:
                assert f"(default: {action.default})" in " ".join(text.split()), f"genai {name} {action.dest}"


def test_option_defaults_are_the_dataclasses():
    """The parser reads them from the source; here they are imported, torch and all."""
    from genai_pipeline.bench import BenchOptions
    from genai_pipeline.data import CalibrationOptions
    from genai_pipeline.evaluate import EvalOptions
    from genai_pipeline.prepare import PrepareOptions
    from genai_pipeline.quantize import QuantOptions
    from genai_pipeline.registry import DEFAULT_MODEL
    from genai_pipeline.runtime.generate import SamplingOptions

    where = {QuantOptions: "quantize", CalibrationOptions: "data/options", PrepareOptions: "prepare",
             EvalOptions: "evaluate", BenchOptions: "bench", SamplingOptions: "runtime/generate"}
    for cls, module in where.items():
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING and not dataclasses.is_dataclass(f.default):
                assert _default(f"{module}:{cls.__name__}", f.name) == f.default, (cls.__name__, f.name)
    assert _default("registry/__init__", "DEFAULT_MODEL") == DEFAULT_MODEL
    defaults = {a.dest: a.default for a in _subparsers(build_parser())["export"]._actions}
    assert defaults["mode"] == PrepareOptions().mode.value and defaults["recipe"] == QuantOptions().recipe


def test_runtime_log_lines_stay_off_the_terminal(export_tiny):
    folder = export_tiny("hybrid")
    argv = [sys.executable, "-m", "genai_pipeline.cli", "run", str(folder), "--prompt", "The list", "--max-new-tokens", "4"]
    quiet = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "GENAI_DEBUG": ""})
    assert quiet.returncode == 0, quiet.stderr
    assert not NATIVE_LOG.search(quiet.stderr + quiet.stdout), quiet.stderr
    assert "genai: " in quiet.stderr and "new tokens" in quiet.stderr  # our own lines still there
    debug = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "GENAI_DEBUG": "1"})
    assert debug.returncode == 0
    assert NATIVE_LOG.search(debug.stderr), debug.stderr  # this runtime does log them (cpuinfo_utils)
