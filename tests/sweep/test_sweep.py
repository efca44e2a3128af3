"""genai sweep on a local Ray (2 CPUs) with the shipped reference model: its rows are what `genai
eval` and `genai bench` give for the same folders, a bad variant fails alone, a re-run skips what is
finished, and a killed worker is retried. Small programs (kv mode, 64 positions) and few tokens.
The shipped reference-vlm likewise: its rows are what `genai eval --images`, `genai eval --text` and
`genai bench` of a vision-language program give."""

import contextlib
import dataclasses
import io
import json
import os
import shutil
import signal
import threading
import time

import pytest
from conftest import REFERENCE

from genai_pipeline.cli import main
from genai_pipeline.sweep.run import run_sweep
from genai_pipeline.sweep.spec import read_spec
from genai_pipeline.sweep.tasks import EXPORT_RECORD, WORKERS, machine, tasks_of

ray = pytest.importorskip("ray")

SPEC = f"""
models:
  - registry: reference
variants:
  - {{name: fp32, recipe: fp32}}
  - {{name: 8da8w-float-embedding, recipe: 8da8w, embedding: fp32}}
  - {{name: qnn-recipe, recipe: 16a8w}}
export: {{mode: kv, max_seq_len: 64}}
eval: {{text: {REFERENCE / "heldout.txt"}, max_tokens: 96}}
bench: {{prompt_len: 16, gen_len: 8, repeats: 1}}
"""
EVAL_FLAGS = ["--text", str(REFERENCE / "heldout.txt"), "--max-tokens", "96"]
BENCH_FLAGS = ["--prompt-len", "16", "--gen-len", "8", "--repeats", "1"]
GOOD = ("reference--fp32", "reference--8da8w-float-embedding")  # a variant with options beside its recipe


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
    assert [rows(result)[t]["status"] for t in GOOD] == ["done"] * len(GOOD)
    assert "failed: target &#x27;xnnpack&#x27; does not support" in (out / "report.html").read_text()


def test_a_rerun_skips_finished_tasks_and_retries_failed_ones(first_run):
    spec, out, first, _ = first_run
    manifests = {t: (out / "exports" / t / "export" / "manifest.json").stat().st_mtime_ns for t in GOOD}
    again = run_sweep(spec, out)
    assert again["skipped"] == len(GOOD) and again["ran"] == 1
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


# ---------------------------------------------------------------- a vision-language model

VLM_QUESTIONS = REFERENCE.parent / "reference-vlm" / "heldout.jsonl"
VLM_SPEC = f"""
models:
  - registry: reference-vlm
variants:
  - {{name: fp32, recipe: fp32}}
  - {{name: 8da8w, recipe: 8da8w}}
export: {{max_seq_len: 128}}
eval: {{images: {VLM_QUESTIONS}, limit: 4, text: {REFERENCE / "heldout.txt"}, max_tokens: 48}}
bench: {{prompt_len: 16, gen_len: 8, repeats: 1}}
"""
VLM_TASKS = ("reference-vlm--fp32", "reference-vlm--8da8w")


@pytest.fixture(scope="module")
def vlm_run(local_ray, export_reference_vlm, tmp_path_factory):
    """`genai sweep` of reference-vlm in fp32 and 8da8w: (DIR, sweep.json, what it printed). The fp32
    task's export is the session's (the same options: its export key), the 8da8w one is made here."""
    folder = tmp_path_factory.mktemp("sweep_vlm")
    (folder / "spec.yaml").write_text(VLM_SPEC)
    fp32 = tasks_of(read_spec(folder / "spec.yaml"))[0]
    shutil.copytree(export_reference_vlm, fp32.folder(folder / "out" / "exports") / "export")
    (fp32.folder(folder / "out" / "exports") / EXPORT_RECORD).write_text(json.dumps({"key": fp32.export_key()}))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["sweep", str(folder / "spec.yaml"), "--out", str(folder / "out")]) == 0
    return folder / "out", json.loads((folder / "out" / "sweep.json").read_text()), printed.getvalue()


def test_a_vision_language_sweep_gives_the_figures_of_genai_eval_images_and_genai_bench(vlm_run, capsys):
    out, result, printed = vlm_run
    assert printed.splitlines()[0].split() == [
        "task", "program", "MB", "perplexity", "answer", "ppl", "exact", "match", "decode", "tok/s", "status"
    ]  # fmt: skip
    assert [line.split()[0] for line in printed.splitlines()[1:]] == list(VLM_TASKS)
    for task in VLM_TASKS:
        row = rows(result)[task]
        folder = out / "exports" / task / "export"
        assert row["status"] == "done" and row["attempts"] == {"export": 1, "bench": 1}
        assert row["exported"] == (task != "reference-vlm--fp32")  # the session's fp32 export is reused
        answered = cli_json(capsys, "eval", str(folder), "--images", str(VLM_QUESTIONS), "--limit", "4", "--json")
        assert row["images"]["questions"] == answered["questions"] == 4
        assert {k: row["images"][k] for k in ("exact_match", "answers_agree", "answer_tokens", "recipe")} == {
            k: answered[k] for k in ("exact_match", "answers_agree", "answer_tokens", "recipe")
        }
        for name, ppl in answered["answer_perplexity"].items():
            assert row["images"]["answer_perplexity"][name] == pytest.approx(ppl, rel=1e-6)
        ppl = answered["answer_perplexity"]
        assert row["answer_perplexity_change_pct"] == pytest.approx(100 * (ppl["program"] / ppl["float"] - 1), abs=1e-3)
        assert (row["exact_match"], row["answers_agree"]) == (
            answered["exact_match"]["program"],
            answered["answers_agree"],
        )
        # its text decoder scored on the text, as `genai eval --text` scores it
        scored = cli_json(
            capsys, "eval", str(folder), "--text", str(REFERENCE / "heldout.txt"), "--max-tokens", "48", "--json"
        )
        assert row["eval"]["tokens"] == scored["tokens"] and row["top1_agreement"] == scored["top1_agreement"]
        assert row["perplexity"] == pytest.approx(scored["perplexity"]["program"], rel=1e-5)
        # speed: `genai bench` of a vision-language program, the same figures in the same units
        benched = cli_json(capsys, "bench", str(folder), *BENCH_FLAGS, "--json")
        assert row["bench"].keys() == benched.keys() and "image_encode_ms" in benched
        assert (row["bench"]["image_tokens"], row["bench"]["prompt_len"]) == (
            benched["image_tokens"],
            benched["prompt_len"],
        )
        assert 0 < row["image_encode_ms"] < row["time_to_first_token_ms"]
        assert row["prefill_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0 and row["peak_rss_mb"] > 0
        assert row["program_mb"] == pytest.approx((folder / "multimodal.pte").stat().st_size / 1e6, abs=1e-3)
        assert row["machine"] == machine()
    assert rows(result)["reference-vlm--fp32"]["answer_perplexity_change_pct"] == pytest.approx(0, abs=1e-3)


def test_a_vision_language_models_report_charts_and_judges_its_answers(vlm_run):
    out, result, _ = vlm_run
    page = (out / "report.html").read_text()
    assert page.count("<circle") == 2 and "answer perplexity change (%)</text>" in page
    assert "<th>exact match %<th>= float %" in page and "smallest program within +5 % answer perplexity: " in page
    # the smaller program is on the Pareto front whatever its answers
    assert "<tr class=pareto><td>8da8w<" in page
