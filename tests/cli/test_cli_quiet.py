"""A quiet, quick CLI: no torch to build the parser, every option's help and default shown, and
ExecuTorch's C++ log lines off the terminal unless GENAI_DEBUG=1."""

import argparse
import dataclasses
import os
import re
import subprocess
import sys
from enum import Enum

from genai_pipeline.cli import build_parser
from genai_pipeline.options import (
    DEFAULT_MODEL,
    BenchOptions,
    CalibrationOptions,
    EvalOptions,
    PrepareOptions,
    QnnOptions,
    QuantOptions,
    SamplingOptions,
)

NATIVE_LOG = re.compile(r"^\[[\w.]+:\d+\]", re.M)  # e.g. "[cpuinfo_utils.cpp:71] Reading file ..."


def _subparsers(parser):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_the_parser_imports_no_torch():
    code = (
        "import sys; from genai_pipeline.cli import build_parser; build_parser(); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'executorch', 'torchao', 'numpy', 'transformers'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "genai_pipeline.cli", "export", "--help"],
        capture_output=True,
        text=True,
    )
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
    """Every flag that sets a field of an option class (options.py) defaults to that field's default."""
    where = {
        "export": {QuantOptions: "", PrepareOptions: "", CalibrationOptions: "calib_", QnnOptions: ""},
        "run": {SamplingOptions: ""},
        "eval": {EvalOptions: ""},
        "bench": {BenchOptions: ""},
    }
    parsers, checked = _subparsers(build_parser()), []
    for command, classes in where.items():
        defaults = {a.dest: a.default for a in parsers[command]._actions}
        for cls, prefix in classes.items():
            for f in dataclasses.fields(cls):
                if prefix + f.name in defaults and f.default is not dataclasses.MISSING:
                    want = f.default.value if isinstance(f.default, Enum) else f.default
                    assert defaults[prefix + f.name] == want, (command, cls.__name__, f.name)
                    checked.append(f.name)
    assert {"recipe", "mode", "max_seq_len", "seq_len", "soc", "temperature", "max_tokens", "prompt_len"} <= set(
        checked
    )
    assert f"else {DEFAULT_MODEL}" in " ".join(parsers["export"].format_help().split())


def test_runtime_log_lines_stay_off_the_terminal(export_tiny):
    folder = export_tiny("hybrid")
    argv = [
        sys.executable,
        "-m",
        "genai_pipeline.cli",
        "run",
        str(folder),
        "--prompt",
        "The list",
        "--max-new-tokens",
        "4",
    ]
    quiet = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "GENAI_DEBUG": ""})
    assert quiet.returncode == 0, quiet.stderr
    assert not NATIVE_LOG.search(quiet.stderr + quiet.stdout), quiet.stderr
    assert "genai: " in quiet.stderr and "new tokens" in quiet.stderr  # our own lines still there
    debug = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "GENAI_DEBUG": "1"})
    assert debug.returncode == 0
    assert NATIVE_LOG.search(debug.stderr), debug.stderr  # this runtime does log them (cpuinfo_utils)
