"""bench/'s scripts: each runs as `python -m bench.<script>` from the repository's root, and the harness
they share runs children and caches stages as they rely on (real child processes)."""

from __future__ import annotations

import sys

import pytest

from bench.harness import ROOT, ChildFailed, cached, last_error_line, run_child

SCRIPTS = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem not in ("__init__", "harness", "png_chart"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_runs_as_a_module(script):
    _, _, printed = run_child([sys.executable, "-m", f"bench.{script}", "--help"])
    assert printed.startswith(f"usage: python -m bench.{script}")


def test_a_child_reports_its_output_time_and_memory():
    wall, peak_rss_mb, printed = run_child([sys.executable, "-c", "print(bytearray(64 << 20)[0])"])
    assert printed == "0\n" and wall > 0 and peak_rss_mb > 64


def test_a_failed_child_names_its_last_error(tmp_path):
    log = tmp_path / "child.log"
    with pytest.raises(ChildFailed) as failed:
        run_child(
            [sys.executable, "-c", "import sys; print('noise', file=sys.stderr); sys.exit('ValueError: no')"], log
        )
    assert str(failed.value).startswith("exit 1:") and "noise" in log.read_text()
    assert last_error_line(failed.value) == "ValueError: no"


def test_a_stage_is_made_once(tmp_path):
    made = []

    def make():
        made.append(1)
        return {"file": "x"}

    assert cached(tmp_path / "stage" / "done.json", make) == cached(tmp_path / "stage" / "done.json", make)
    assert made == [1]
