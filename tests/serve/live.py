"""A live `genai serve` in a child process on a free loopback port, as a user starts it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class LiveServer:
    """`genai serve FOLDER --port 0 FLAGS`; `url` is the base URL it says it serves on, `log` its stderr."""

    def __init__(self, folder: Path, *flags: str, env: dict[str, str] | None = None, timeout: float = 300):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "genai_pipeline.cli", "serve", str(folder), "--port", "0", *flags],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
            cwd=REPO,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)  # and keeps the pipe from filling
        self.reader.start()
        deadline = time.monotonic() + timeout
        while (found := self._url()) is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"genai serve did not start:\n{self.log}")
            time.sleep(0.05)
        self.url = found

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)

    def _url(self) -> str | None:
        match = next((re.search(r" on (http://\S+/v1) ", line) for line in self.lines if "serving" in line), None)
        return match.group(1) if match else None

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> int:
        """SIGTERM, as a service manager stops it; its exit code."""
        if self.process.poll() is None:
            self.process.terminate()
        code = self.process.wait(timeout=60)
        self.reader.join(timeout=10)  # its last lines
        return code
