"""What the comparison scripts share: child processes (wall time, peak RSS, a log of stderr), stages cached
in a done.json, the host they ran on, and the snapshot of genai_pipeline/ that `genai` runs from.

Imports nothing but the standard library at module level: the peers' venvs (bench/.envs) import it too,
when `python -m bench.peers _run-...` runs a worker there.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MAIN_PY = Path(sys.executable)  # the scripts run under the main venv (genai, torch, transformers)
ENVS = (HERE / ".envs").resolve()  # may be a link to venvs shared between work trees

# ExecuTorch's custom SDPA kernel calls MKL from inside ExecuTorch's thread pool: with OpenMP's default team
# size its idle threads spin on the cores XNNPACK needs (docs/decisions/0002). `genai run`/`bench` set this for
# themselves; every ExecuTorch program here runs with it, ours and optimum's alike.
ONE_OMP_THREAD = {"OMP_NUM_THREADS": "1"}


class ChildFailed(Exception):
    """A child process exited non-zero; the message ends with the tail of its log."""


def run_child(
    argv: list, log: Path | None = None, env: dict | None = None, cwd: Path | str = ROOT
) -> tuple[float, float, str]:
    """Wall seconds, peak RSS in MB and stdout of one child process; its stderr goes to `log`. It runs
    from the repository's root unless told otherwise: there `python -m bench.X` finds the workers."""
    start = time.perf_counter()
    err = open(log, "w") if log else subprocess.DEVNULL
    try:
        child = subprocess.Popen(
            [str(a) for a in argv],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
        out = child.stdout.read()
        _, status, usage = os.wait4(child.pid, 0)
    finally:
        if log:
            err.close()
    if os.waitstatus_to_exitcode(status) != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:] if log and log.exists() else []
        raise ChildFailed(f"exit {os.waitstatus_to_exitcode(status)}: {' '.join(map(str, argv))}\n" + "\n".join(tail))
    return time.perf_counter() - start, usage.ru_maxrss / 1024, out


def last_error_line(e: Exception) -> str:
    lines = [l for l in str(e).splitlines() if l.strip()]
    errs = [l.strip() for l in lines if "Error" in l or "error" in l]
    return (errs[-1] if errs else lines[-1] if lines else repr(e))[:400]


def cached(done: Path, make) -> dict:
    """The stage's record from `done` (a JSON file), or make() it and write it."""
    if done.exists():
        return json.loads(done.read_text())
    record = make()
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(record, indent=2) + "\n")
    return record


def say(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def main_or_worker(main, workers: dict) -> None:
    """A script's entry point: `python -m bench.X _worker ARGS...` runs that worker (a child of the script's,
    perhaps in a peer's venv); anything else is the script's own command line."""
    if sys.argv[1:2] and sys.argv[1] in workers:
        workers[sys.argv[1]](sys.argv[2:])
    else:
        main()


def genai_source(ref: str, work: Path) -> dict:
    """Where `genai` runs from: a snapshot of git `ref`'s genai_pipeline/ (other engineers edit the
    working tree while this runs) and its assets/, or the working tree itself with ref 'worktree'."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if ref == "worktree":
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "genai_pipeline"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return {
            "ref": "worktree",
            "sha": head + ("-dirty" if dirty else ""),
            "key": "worktree",
            "cwd": str(ROOT),
            "env": {},
        }
    sha = subprocess.run(["git", "rev-parse", ref], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    # exports are named by the content of genai_pipeline/ and assets/ (their git tree ids), not by the commit:
    # a commit elsewhere (bench/, tests/) reuses them
    trees = subprocess.run(
        ["git", "rev-parse", f"{sha}:genai_pipeline", f"{sha}:assets"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    key = hashlib.sha1(" ".join(trees).encode()).hexdigest()[:12]
    dest = work / "genai-src" / key
    if not (dest / "assets").exists():
        dest.mkdir(parents=True, exist_ok=True)
        # assets/: the calibration text the 8da4w recipe's GPTQ reads, beside the package
        archive = subprocess.run(
            ["git", "archive", sha, "genai_pipeline", "assets"], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    # `python -m` puts the current directory first on sys.path: run from the snapshot; bench/ (the workers)
    # comes from the working tree, after it
    return {"ref": ref, "sha": sha, "key": key, "cwd": str(dest), "env": {"PYTHONPATH": f"{dest}{os.pathsep}{ROOT}"}}


def machine() -> dict:
    """What ran this: the CPU's model and flags (AMX, AVX-512 VNNI, ... decide which kernels run) and how busy
    the shared host was."""
    cpu = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "flags", "cpu family", "model") and key.strip() not in cpu:
            cpu[key.strip()] = value.strip()
    flags = cpu.get("flags", "").split()
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "cpu_model": cpu.get("model name"),
        "cpu_family": cpu.get("cpu family"),
        "cpu_model_number": cpu.get("model"),
        "amx": [f for f in flags if f.startswith("amx")],
        "avx512": [f for f in flags if f.startswith("avx512") or f in ("avx_vnni", "avx2", "fma", "f16c")],
        "cpu_flags": flags,
        "loadavg_start": os.getloadavg(),
    }
