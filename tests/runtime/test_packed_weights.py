"""A hybrid program's methods share one packed copy of the weights in memory (XNNPACK's weights
cache), as they share one stored copy on disk: `genai bench` in a child process per program."""

import json
import os
import subprocess
import sys

from conftest import REPO


def program_rss_mb(folder, **env) -> float:
    """What loading and running the program adds to a process: `genai bench`'s peak RSS minus its
    RSS before loading (the libraries, ~360 MB, the same for every program)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "genai_pipeline.cli",
            "bench",
            str(folder),
            "--prompt-len",
            "64",
            "--gen-len",
            "8",
            "--repeats",
            "1",
            "--json",
        ],
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    r = json.loads(out)
    return r["peak_rss_mb"] - r["rss_before_load_mb"]


def test_hybrid_program_packs_each_weight_once(export_reference):
    # fp32: the reference model's 17 MB of weights are packed as they are, so one more copy shows.
    hybrid, dynamic = export_reference("hybrid"), export_reference("dynamic")
    assert program_rss_mb(hybrid) <= 1.05 * program_rss_mb(dynamic)
    # The control: without the cache, prefill and decode each pack their own copy.
    assert program_rss_mb(hybrid, GENAI_XNNPACK_WEIGHT_CACHE="0") > 1.3 * program_rss_mb(hybrid)
