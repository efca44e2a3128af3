"""The sweep on Ray: every task's stages as Ray tasks with their resources declared, Ray placing them.

- `ray.init()` starts a local Ray on this machine unless one is running in this process; `address`
  joins an existing cluster (`ray start --head` on one node, `ray start --address` on the others).
- The export stage declares one CPU and the memory an export of its model takes (tasks.py); the
  bench stage declares every CPU of the largest node, so nothing else runs beside it and every speed
  figure of a sweep comes from one kind of node.
- Each stage runs in a fresh worker process (`max_calls=1`): an export's peak RSS is its own, memory
  goes back between tasks, and bench gets one OpenMP thread as `genai bench` does (docs/decisions/0002).
- A worker that dies (killed, out of memory, a node lost) is retried by Ray (MAX_RETRIES); a task
  that still fails, or fails by its input (a recipe the target refuses), is recorded with its one-line
  error and the others go on.
- Rows are written to OUT/tasks/<task>.json as tasks finish: a re-run skips the tasks whose row is
  done under the same key and retries the failed ones.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path

from genai_pipeline.errors import GenAIError
from genai_pipeline.sweep.report import ANSWERS, PERPLEXITY, write_report
from genai_pipeline.sweep.spec import Spec
from genai_pipeline.sweep.tasks import (
    Task,
    attempts,
    bench_memory_bytes,
    bench_stage,
    check_models,
    export_memory_bytes,
    export_stage,
    model_params,
    tasks_of,
)

log = logging.getLogger(__name__)

MAX_RETRIES = 2  # a stage whose worker died runs again this many times
BENCH_ENV = {"OMP_NUM_THREADS": "1"}  # as the CLI sets for `genai bench` (cli.one_openmp_thread_per_caller)


def run_sweep(spec: Spec, out: Path, storage: Path | None = None, address: str | None = None) -> dict:
    """Run every task of `spec` not finished before; write OUT/sweep.json and OUT/report.html and
    return the sweep's result (what sweep.json holds). SpecError, before anything starts, where the spec
    does not fit its models (tasks.check_models)."""
    import ray

    check_models(spec)
    out = Path(out).resolve()
    storage = Path(storage).resolve() if storage else out / "exports"
    (out / "tasks").mkdir(parents=True, exist_ok=True)
    storage.mkdir(parents=True, exist_ok=True)
    started_here = not ray.is_initialized()
    if started_here:
        _init(address)
    try:
        return _Sweep(spec, out, storage).run()
    finally:
        if started_here:
            ray.shutdown()


def _init(address: str | None) -> None:
    import ray

    if address is not None:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        return
    # "local": a new Ray of this process even where `ray start` left one running (join that one with
    # --address auto). The object store carries rows only (export folders go to the storage folder):
    # a small one leaves the node's memory to the tasks.
    ray.init(
        address="local",
        include_dashboard=False,
        object_store_memory=256 << 20,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )


class _Sweep:
    def __init__(self, spec: Spec, out: Path, storage: Path):
        self.spec, self.out, self.storage = spec, out, storage
        self.run_id = uuid.uuid4().hex[:12]
        self.rows: dict[str, dict] = {}
        self.pending: dict = {}  # object ref -> (task, stage)
        self.start = time.time()
        self.finished = 0  # tasks finished in this run (not skipped)
        self.exports_ended = 0  # export stages ended in this run, done or failed
        self.bench_seconds: list[float] = []  # how long each bench stage of this run took

    def run(self) -> dict:
        tasks = tasks_of(self.spec)
        todo = [task for task in tasks if not self._finished_before(task)]
        skipped = len(tasks) - len(todo)
        log.info(
            "sweep: %d tasks, %d finished before (skipped), %d to run; exports in %s",
            len(tasks),
            skipped,
            len(todo),
            self.storage,
        )
        self.total = len(todo)
        params = {}
        for task in todo:
            if task.model.name not in params:
                params[task.model.name] = self._params(task)
            error = self._cannot_place(task, params[task.model.name])
            if error is not None:
                self.exports_ended += 1
                self._finish(task, {"error": error})
            else:
                self._submit(task, "export", params[task.model.name])
        while self.pending:
            self._wait(params)
        return self._report()

    def _report(self) -> dict:
        """sweep.json and report.html of the rows so far (all of them at the end): the report can be
        read while the sweep runs."""
        tasks = tasks_of(self.spec)
        result = {
            "spec": str(self.spec.source),
            "storage": str(self.storage),
            "seconds": round(time.time() - self.start, 1),
            "ran": self.total,
            "skipped": len(tasks) - self.total,
            "rows": [self.rows[task.name] for task in tasks if "status" in self.rows.get(task.name, {})],
        }
        write_report(self.out, result, self.spec.report)
        return result

    def _finished_before(self, task: Task) -> bool:
        path = self.out / "tasks" / f"{task.name}.json"
        try:
            key = task.key()
        except GenAIError:
            return False  # told when it runs
        if not path.is_file():
            return False
        row = json.loads(path.read_text())
        if row.get("status") != "done" or row.get("key") != key:
            return False
        self.rows[task.name] = {**row, "skipped": True}
        return True

    def _params(self, task: Task) -> int | str:
        """The model's parameter count, or the one-line error of reading its checkpoint."""
        try:
            return model_params(task.model)
        except GenAIError as e:
            return str(e)

    def _cannot_place(self, task: Task, params: int | str) -> str | None:
        """Why no node can take the task's export (Ray would wait for one for ever), or None."""
        if isinstance(params, str):  # the model's checkpoint cannot be read
            return params
        need, largest = export_memory_bytes(task.model, params), _largest_node("memory")
        if need > largest:
            return (
                f"an export of {task.model.name} declares {need / 1e9:.1f} GB and the largest Ray node offers "
                f"{largest / 1e9:.1f} GB: add a larger node, or set the model's memory_gb if it needs less"
            )
        return None

    def _submit(self, task: Task, stage: str, params: int) -> None:
        import ray

        args = ()
        if stage == "export":
            remote = ray.remote(max_calls=1)(export_stage).options(
                num_cpus=1,
                memory=export_memory_bytes(task.model, params),
                max_retries=MAX_RETRIES,
                retry_exceptions=False,
                name=f"export {task.name}",
            )
        else:
            cpus = _largest_node("CPU")
            args = (int(cpus),)  # bench's threads unless the spec names them: the CPUs it holds
            remote = ray.remote(max_calls=1)(bench_stage).options(
                num_cpus=cpus,
                memory=bench_memory_bytes(params),
                max_retries=MAX_RETRIES,
                retry_exceptions=False,
                runtime_env={"env_vars": BENCH_ENV},
                name=f"bench {task.name}",
            )
        self.pending[remote.remote(task, self.storage, self.run_id, *args)] = (task, stage)

    def _wait(self, params: dict) -> None:
        import ray

        ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=60)
        if not ready:
            self._progress()
            return
        task, stage = self.pending.pop(ready[0])
        try:
            result = ray.get(ready[0])
        except ray.exceptions.RayError as e:
            result = {"error": _one_line(e)}
        if stage == "export":
            self.exports_ended += 1
        else:
            started = attempts(task, self.storage, self.run_id, "bench")
            self.bench_seconds += [time.time() - started[-1]["time"]] if started else []
        if "machine" in result:
            _mark_shared_host(result["machine"])
        row = self.rows.setdefault(task.name, {})
        row.update(result)
        if stage == "export" and "error" not in result:
            self._submit(task, "bench", params[task.model.name])
        else:
            self._finish(task, row)
        self._progress()

    def _finish(self, task: Task, row: dict) -> None:
        try:
            key = task.key()
        except GenAIError:
            key = None
        failed = "error" in row
        row = {
            "task": task.name,
            "model": task.model.name,
            "variant": task.variant.name,
            "target": task.variant.target,
            "key": key,
            "status": "failed" if failed else "done",
            "attempts": {s: len(attempts(task, self.storage, self.run_id, s)) for s in ("export", "bench")},
            **row,
        }
        self.rows[task.name] = row
        path = self.out / "tasks" / f"{task.name}.json"
        path.write_text(json.dumps(row, indent=1))
        self.finished += 1
        self._report()
        if failed:
            log.warning("sweep: %s failed: %s", task.name, row["error"])
        else:
            changes = [f"{a.name} {row[a.key]:+.{a.digits}f} %" for a in (PERPLEXITY, ANSWERS) if a.key in row]
            log.info("sweep: %s done: %.2f MB, %s", task.name, row["program_mb"], ", ".join(changes))

    def _progress(self) -> None:
        running = sum(1 for task, stage in self.pending.values() if attempts(task, self.storage, self.run_id, stage))
        failed = sum(1 for r in self.rows.values() if r.get("status") == "failed" and not r.get("skipped"))
        elapsed = time.time() - self.start
        left = self.total - self.finished
        eta = "ETA after an export ends"
        if self.exports_ended:
            # exports take most of the time (in parallel, as this run's so far); benches run one a node
            exports = elapsed / self.exports_ended * (self.total - self.exports_ended)
            benches = left * sum(self.bench_seconds) / len(self.bench_seconds) if self.bench_seconds else 0.0
            eta = f"ETA {(exports + benches) / 60:.1f} min"
        log.info(
            "sweep: %d/%d done, %d running, %d failed, %.1f min so far, %s",
            self.finished - failed,
            self.total,
            running,
            failed,
            elapsed / 60,
            eta if left else "finished",
        )


def _largest_node(resource: str) -> float:
    """The most of `resource` (CPU, memory) one node of the cluster has."""
    import ray

    return max(node["Resources"].get(resource, 0) for node in ray.nodes() if node["Alive"])


def _mark_shared_host(machine: dict) -> None:
    """A bench is alone on its Ray node; where several Ray nodes share one host (a simulated
    cluster), the others' tasks may have run beside it: its speeds are marked as measured under load."""
    import ray

    nodes = sum(1 for node in ray.nodes() if node["Alive"] and node["NodeManagerHostname"] == machine["host"])
    if nodes > 1:
        machine["ray_nodes_on_host"] = nodes


def _one_line(e: Exception) -> str:
    """A Ray failure as one line: the task's own exception, or what happened to its worker."""
    import ray

    if isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        cause = e.cause
        return f"internal error: {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    if isinstance(e, ray.exceptions.OutOfMemoryError):
        return "out of memory: the worker was killed after its retries; give the model more memory_gb in the spec"
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {first}"
