"""upstream/pins.py: the one place the pinned torch / ExecuTorch / torchao / gguf versions are written, and
the check every module of upstream/ calls. Fails first when an installed wheel is not the pinned one:
then re-check each module of genai_pipeline/upstream/ (docs/upstream-patches.md) before moving a pin."""

import logging
import re
import tomllib

import pytest
from conftest import REPO
from pretend_installed import pretend_installed

from genai_pipeline.errors import ExportError
from genai_pipeline.upstream import pins


def test_the_installed_wheels_are_the_pinned_ones():
    for package, version in pins.PINNED.items():
        assert pins.installed(package) == version, (
            f"{package}: re-check genai_pipeline/upstream/ against {pins.installed(package)}"
        )
    assert pins.pinned("torch", "executorch", "torchao")


def test_pyproject_pins_the_same_versions():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = dict(d.split("==") for d in dependencies if "==" in d)
    assert {package: pinned[package] for package in pins.PINNED} == pins.PINNED


def test_the_pinned_versions_are_written_once():
    written = [
        f"{path.relative_to(REPO)}: {line}"
        for path in (REPO / "genai_pipeline").rglob("*.py")
        for line in path.read_text().splitlines()
        if re.match(r"\s*PINNED_(TORCH|EXECUTORCH|TORCHAO|GGUF)\s*=", line)
    ]
    assert sorted(written) == [
        f'genai_pipeline/upstream/pins.py: PINNED_{p.upper()} = "{v}"' for p, v in sorted(pins.PINNED.items())
    ]


def test_a_local_version_suffix_is_not_part_of_the_version(monkeypatch):
    monkeypatch.setattr(pins, "version", lambda package: "2.13.0+cpu")
    pins.installed.cache_clear()
    try:
        assert pins.installed("torch") == "2.13.0" and pins.pinned("torch")
    finally:
        pins.installed.cache_clear()


def test_another_version_warns_once_or_stops_with_one_line(monkeypatch, caplog):
    pretend_installed(monkeypatch, executorch="1.6.0")
    log = logging.getLogger("genai_pipeline.upstream.test")
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert not pins.warn_unpinned(log, "patch left out", "torch", "executorch")
        assert not pins.warn_unpinned(log, "patch left out", "torch", "executorch")
        assert pins.warn_unpinned(log, "patch left out", "torch")
    assert [r.getMessage() for r in caplog.records] == ["patch left out: executorch 1.6.0 (pinned: 1.5.1)"]
    pins.require_pinned("a patch", "torch")
    with pytest.raises(ExportError) as e:
        pins.require_pinned("a patch", "executorch")
    assert (
        str(e.value)
        == "a patch is written for executorch==1.5.1, found executorch 1.6.0: install the versions pyproject.toml pins"
    )
