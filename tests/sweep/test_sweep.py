"""genai sweep on a local Ray (2 CPUs) with the shipped reference model: its rows are what `genai
eval` and `genai bench` give for the same folders, a bad variant fails alone, a re-run skips what is
finished, and a killed worker is retried. Small programs (kv mode, 64 positions) and few tokens."""

import contextlib
import dataclasses
import io
import json
import os
import signal
import threading
import time

import pytest
from conftest import REFERENCE

from genai_pipeline.cli import main
from genai_pipeline.sweep.run import run_sweep
from genai_pipeline.sweep.spec import read_spec
from genai_pipeline.sweep.tasks import WORKERS, machine

ray = pytest.importorskip("ray")

SPEC = f"""
models:
  - registry: reference
variants:
  - {{name: fp32, recipe: fp32}}
  - {{name: 8da8w, recipe: 8da8w}}
  - {{name: 8da8w-float-embedding, recipe: 8da8w, embedding: fp32}}
  - {{name: qnn-recipe, recipe: 16a8w}}
export: {{mode: kv, max_seq_len: 64}}
eval: {{text: {REFERENCE / "heldout.txt"}, max_tokens: 96}}
bench: {{prompt_len: 16, gen_len: 8, repeats: 1}}
"""
EVAL_FLAGS = ["--text", str(REFERENCE / "heldout.txt"), "--max-tokens", "96"]
BENCH_FLAGS = ["--prompt-len", "16", "--gen-len", "8", "--repeats", "1"]
GOOD = ("reference--fp32", "reference--8da8w", "reference--8da8w-float-embedding")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def first_run(local_ray, tmp_path_factory):
    """`genai sweep` (it joins the Ray this process runs): (spec, DIR, sweep.json, what it printed)."""
    folder = tmp_path_factory.mktemp("sweep")
    (folder / "spec.yaml").write_text(SPEC)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["sweep", str(folder / "spec.yaml"), "--out", str(folder / "out")])
    assert code == 1  # one task failed
    result = json.loads((folder / "out" / "sweep.json").read_text())
    return read_spec(folder / "spec.yaml"), folder / "out", result, printed.getvalue()


def rows(result) -> dict:
    return {r["task"]: r for r in result["rows"]}


def cli_json(capsys, *argv) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_a_sweep_gives_the_figures_of_genai_eval_and_genai_bench(first_run, capsys):
    _, out, result, printed = first_run
    assert [line.split()[0] for line in printed.splitlines()] == ["task", *GOOD, "reference--qnn-recipe"]
    for task in GOOD:
        row = rows(result)[task]
        assert row["status"] == "done" and row["exported"] and row["attempts"] == {"export": 1, "bench": 1}
        folder = out / "exports" / task / "export"
        assert row["folder"] == str(folder)
        evaluated = cli_json(capsys, "eval", str(folder), *EVAL_FLAGS, "--json")
        assert row["eval"]["tokens"] == evaluated["tokens"] > 80
        for name, ppl in evaluated["perplexity"].items():
            assert row["eval"]["perplexity"][name] == (ppl if ppl is None else pytest.approx(ppl, rel=1e-5))
        assert row["kl_divergence"] == pytest.approx(evaluated["kl_divergence"], rel=1e-3, abs=1e-7)
        assert row["top1_agreement"] == evaluated["top1_agreement"]
        change = 100 * (evaluated["perplexity"]["program"] / evaluated["perplexity"]["float"] - 1)
        assert row["perplexity_change_pct"] == pytest.approx(change, abs=1e-3)
        # sizes: what is on disk
        assert row["files"] == {f.name: f.stat().st_size for f in folder.iterdir() if f.name != "manifest.json"}
        assert row["program_mb"] == pytest.approx((folder / "text_decoder.pte").stat().st_size / 1e6, abs=1e-3)
        # speed: the same figures, in the same units, measured on this machine
        benched = cli_json(capsys, "bench", str(folder), *BENCH_FLAGS, "--json")
        assert row["bench"].keys() == benched.keys()
        assert row["bench"]["weight_bytes_per_token"] == benched["weight_bytes_per_token"]
        assert row["decode_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0 and row["peak_rss_mb"] > 0
        assert row["export_peak_rss_mb"] > 0 and row["export_minutes"] > 0
        assert row["machine"] == machine()  # the CPU model and the threads bench used
    assert rows(result)["reference--fp32"]["perplexity_change_pct"] == pytest.approx(0, abs=1e-3)


def test_the_report_names_the_machine_marks_the_pareto_rows_and_recommends(first_run):
    _, out, result, _ = first_run
    page = (out / "report.html").read_text()
    assert f"{machine()['cpu']} ({machine()['vector']}), {machine()['threads']} threads" in page
    assert "<svg" in page and "<script" not in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")
    assert page.count("<circle") == len(GOOD)
    # the smallest program is on the Pareto front whatever its accuracy
    smallest = min((rows(result)[t] for t in GOOD), key=lambda r: r["program_mb"])
    assert f"<tr class=pareto><td>{smallest['variant']}<" in page
    assert "smallest program within +5 % perplexity: " in page and "up to " in page


def test_a_variant_its_target_refuses_fails_alone_with_one_line(first_run):
    _, out, result, _ = first_run
    row = rows(result)["reference--qnn-recipe"]
    assert row["status"] == "failed"
    assert row["error"].startswith("target 'xnnpack' does not support recipe '16a8w'") and "\n" not in row["error"]
    assert [rows(result)[t]["status"] for t in GOOD] == ["done"] * 3
    assert "failed: target &#x27;xnnpack&#x27; does not support" in (out / "report.html").read_text()


def test_a_rerun_skips_finished_tasks_and_retries_failed_ones(first_run):
    spec, out, first, _ = first_run
    manifests = {t: (out / "exports" / t / "export" / "manifest.json").stat().st_mtime_ns for t in GOOD}
    again = run_sweep(spec, out)
    assert again["skipped"] == 3 and again["ran"] == 1
    for task in GOOD:
        assert rows(again)[task]["skipped"] and rows(again)[task]["key"] == rows(first)[task]["key"]
        # no export, no worker at all: the folder is untouched and no stage started
        assert (out / "exports" / task / "export" / "manifest.json").stat().st_mtime_ns == manifests[task]
        assert len((out / "exports" / task / WORKERS).read_text().splitlines()) == 2
    retried = rows(again)["reference--qnn-recipe"]
    assert retried["status"] == "failed" and retried["attempts"] == {"export": 1, "bench": 0}


def test_a_killed_worker_is_retried(first_run, tmp_path):
    spec, out, _, _ = first_run
    # Another sweep of the fp32 variant over the same storage: its export is reused, its evaluation
    # runs again; the worker is killed as soon as it has started.
    one = dataclasses.replace(spec, variants=spec.variants[:1])
    task_folder = out / "exports" / "reference--fp32"
    lines_before = len((task_folder / WORKERS).read_text().splitlines())
    done = {}
    sweep = threading.Thread(target=lambda: done.update(run_sweep(one, tmp_path / "out", storage=out / "exports")))
    sweep.start()
    deadline = time.time() + 60
    while len((task_folder / WORKERS).read_text().splitlines()) == lines_before:
        assert time.time() < deadline, "the export stage never started"
        time.sleep(0.05)
    worker = json.loads((task_folder / WORKERS).read_text().splitlines()[-1])
    os.kill(worker["pid"], signal.SIGKILL)
    sweep.join(timeout=120)
    row = done["rows"][0]
    assert row["status"] == "done" and row["attempts"] == {"export": 2, "bench": 1}
    assert not row["exported"]  # the retry reused the export of the same key


def test_an_export_no_node_can_hold_fails_at_once(local_ray, tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("- registry: reference", "- {registry: reference, memory_gb: 100000}"))
    result = run_sweep(read_spec(spec), tmp_path / "out")  # Ray would wait for such a node for ever
    errors = {r["error"] for r in result["rows"]}
    assert len(errors) == 1 and next(iter(errors)).startswith("an export of reference declares 100000.0 GB")
    assert not (tmp_path / "out" / "exports" / "reference--fp32").exists()
