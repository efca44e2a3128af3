"""pretend_installed(monkeypatch, executorch="1.6.0"): upstream/pins.py answers as if those versions
were installed (the pinned ones for the rest), and logs its warnings afresh; undone after the test."""

import functools

from genai_pipeline.upstream import pins


def pretend_installed(monkeypatch, **versions: str) -> None:
    monkeypatch.setattr(pins, "installed", lambda package: versions.get(package, pins.PINNED[package]))
    monkeypatch.setattr(pins, "warn_unpinned", functools.cache(pins.warn_unpinned.__wrapped__))
