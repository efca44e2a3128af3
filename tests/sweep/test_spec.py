"""A sweep's spec: read into the option classes, every error told on its own line, torch-free."""

import json
import subprocess
import sys

import pytest
from conftest import REFERENCE

from genai_pipeline.cli import main
from genai_pipeline.names import Mode
from genai_pipeline.sweep.spec import SPEC_EXAMPLE, SpecError, read_spec

GOOD = f"""
models:
  - registry: reference
  - {{name: local, checkpoint: {REFERENCE}, memory_gb: 2}}
variants:
  - {{name: fp32, recipe: fp32}}
  - {{name: small, recipe: 8da4w, size_budget: 80, overrides: ["output=8da8w"], group_size: 64, mode: kv}}
  - {{name: calibrated, recipe: 8a8w, calib: ["text:heldout.txt"], calib_limit: 4}}
export: {{max_seq_len: 128}}
eval: {{text: heldout.txt, max_tokens: 256}}
bench: {{gen_len: 16}}
report: {{size_classes_mb: [5, 10]}}
"""


def write(tmp_path, text: str):
    (tmp_path / "heldout.txt").write_text("some text to score " * 20)
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


def test_a_spec_reads_into_the_option_classes(tmp_path):
    spec = read_spec(write(tmp_path, GOOD))
    assert [m.name for m in spec.models] == ["reference", "local"]
    assert spec.models[1].checkpoint == REFERENCE.resolve() and spec.models[1].memory_gb == 2
    small = spec.variants[1]
    assert small.quant.recipe == "8da4w" and small.quant.size_budget == 80 and small.quant.group_size == 64
    assert small.quant.overrides == (("output", "8da8w"),)
    assert spec.prepare_for(spec.models[1], small).mode is Mode.KV
    assert spec.prepare_for(spec.models[1], spec.variants[0]).checkpoint == REFERENCE.resolve()
    assert spec.prepare.max_seq_len == 128 and spec.prepare.mode is Mode.HYBRID
    # paths are relative to the spec's folder
    assert spec.eval.text == tmp_path / "heldout.txt" and spec.eval.max_tokens == 256
    assert str(spec.variants[2].quant.calibration.datasets[0]) == f"text:{tmp_path / 'heldout.txt'}"
    assert spec.bench.gen_len == 16 and spec.bench.prompt_len == 128  # the rest: BenchOptions' defaults
    assert spec.report.size_classes_mb == (5, 10) and spec.report.max_perplexity_change == 5


def test_every_error_of_a_spec_is_one_line(tmp_path):
    bad = """
models:
  - {name: a, checkpoint: nowhere}
  - {registry: reference, weights: x}
variants:
  - {name: v, recipe: 9bit}
  - {name: u, recipe: fp32, size_budget: 80}
  - {name: w, recipe: fp32}
  - {name: w, recipe: 8da8w}
  - {name: "bad name", recipe: fp32}
export: {max_seq_len: "long"}
bench: {repeats: 0}
colour: blue
"""
    with pytest.raises(SpecError) as e:
        read_spec(write(tmp_path, bad))
    lines = str(e.value).splitlines()
    where = [line.split(": ")[1] for line in lines]
    assert where == [
        "colour",
        "models[0].checkpoint",
        "models[1].weights",
        "variants[0]",
        "variants[1]",
        "variants[4].name",
        "variants",
        "export",
        "eval",
        "bench",
    ], lines
    assert all(line.startswith(f"{tmp_path / 'spec.yaml'}: ") for line in lines)
    assert "unknown recipe '9bit'" in lines[3] and "--size-budget" in lines[4]
    assert "'w' is given twice" in lines[6] and "max_seq_len: a number" in lines[7]


def test_the_cli_tells_a_bad_spec_in_lines_and_exits_2(tmp_path, capsys):
    path = write(tmp_path, "models: []\nvariants: 3\n")
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert [line.removeprefix("error: ").split(": ")[1] for line in err.splitlines()] == ["models", "variants", "eval"]
    assert not (tmp_path / "out").exists()  # nothing started
    assert main(["sweep", str(tmp_path / "missing.yaml"), "--out", "x"]) == 2
    assert "sweep spec" in capsys.readouterr().err
    path.write_text("models: [\n")
    assert main(["sweep", str(path), "--out", "x"]) == 2
    assert "not YAML at line" in capsys.readouterr().err


def test_the_help_shows_the_spec_format_without_loading_torch():
    code = (
        "import sys, contextlib, io\n"
        "from genai_pipeline.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit): main(['sweep', '--help'])\n"
        "print('torch' in sys.modules, 'ray' in sys.modules)\n"
        "print(out.getvalue())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.startswith("False False")
    assert SPEC_EXAMPLE in result.stdout and "docs/sweep.md" in result.stdout


VLM_QUESTIONS = REFERENCE.parent / "reference-vlm" / "heldout.jsonl"
MIXED = f"""
models:
  - registry: reference
  - registry: reference-vlm
variants:
  - {{name: fp32, recipe: fp32}}
eval: {{text: heldout.txt, images: {VLM_QUESTIONS}, limit: 3}}
"""


def test_a_spec_with_image_questions_gives_them_to_the_vision_language_models_only(tmp_path):
    from genai_pipeline.sweep.tasks import check_models, tasks_of

    spec = read_spec(write(tmp_path, MIXED))
    assert spec.images.images == VLM_QUESTIONS and spec.images.limit == 3 and spec.eval.text == tmp_path / "heldout.txt"
    check_models(spec)  # each model has its evaluation
    text, vlm = tasks_of(spec)
    assert (text.eval, text.images) == (spec.eval, None) and (vlm.eval, vlm.images) == (spec.eval, spec.images)
    # the image questions are inputs of the vision-language tasks only: the text task's key ignores them
    only_text = read_spec(write(tmp_path, MIXED.replace(f", images: {VLM_QUESTIONS}, limit: 3", "")))
    assert tasks_of(only_text)[0].key() == text.key() and tasks_of(only_text)[0].images is None
    # a variant's tower recipe: for vision-language models only
    tower = read_spec(write(tmp_path, MIXED.replace("recipe: fp32}", "recipe: 8da8w, vision_recipe: fp32}")))
    assert tower.variants[0].quant.vision_recipe == "fp32"
    with pytest.raises(SpecError) as e:
        check_models(tower)
    assert str(e.value) == (
        f"{tmp_path / 'spec.yaml'}: variants[0].vision_recipe: reference is a text model (no image tower): "
        "sweep vision-language models with such variants in a spec of their own"
    )


@pytest.mark.parametrize(
    "models, evaluation, expected",
    [
        # a text model with image questions only: nothing would score it
        (
            ["reference", "reference-vlm"],
            f"{{images: {VLM_QUESTIONS}}}",
            ["models[0]: reference is a text model and eval gives image questions only: give eval.text"],
        ),
        # a vision-language model without its questions: its tower would go unmeasured
        (
            ["reference-vlm"],
            "{text: heldout.txt}",
            ["models[0]: reference-vlm is a vision-language model: give eval.images"],
        ),
        # image questions that no model answers
        (["reference"], f"{{text: heldout.txt, images: {VLM_QUESTIONS}}}", ["eval.images: no model of the spec is"]),
        # questions whose file is not what genai eval --images reads: told before any export
        (["reference-vlm"], "{images: bad.jsonl}", ["eval.images: ", "bad.jsonl:2: image ", "does not exist"]),
        # a speech model: genai eval and genai bench refuse its exports, so its tasks would only fail
        (["voxtral-mini-3b"], "{text: heldout.txt}", ["models[0]: voxtral-mini-3b is a speech model: genai eval"]),
    ],
    ids=["text-model-images-only", "vlm-text-only", "images-no-vlm", "bad-questions", "speech"],
)
def test_a_model_without_its_evaluation_is_a_spec_error_before_any_work(tmp_path, capsys, models, evaluation, expected):
    (tmp_path / "bad.jsonl").write_text(
        json.dumps({"image": str(VLM_QUESTIONS.parent / "heldout/0000.png"), "prompt": "p", "answer": "a"})
        + "\n"
        + json.dumps({"image": "missing.png", "prompt": "p", "answer": "a"})
        + "\n"
    )
    listed = "\n".join(f"  - registry: {m}" for m in models)
    path = write(tmp_path, f"models:\n{listed}\nvariants: [{{name: fp32, recipe: fp32}}]\neval: {evaluation}\n")
    assert main(["sweep", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and len(err.splitlines()) == 1 and "Traceback" not in err
    assert all(part in err for part in expected), err
    assert not (tmp_path / "out").exists()  # nothing started


def test_the_eval_section_needs_a_text_or_image_questions(tmp_path):
    with pytest.raises(SpecError) as e:
        read_spec(write(tmp_path, GOOD.replace("eval: {text: heldout.txt, max_tokens: 256}", "eval: {limit: 3}")))
    assert [line.split(": ", 1)[1] for line in str(e.value).splitlines()] == [
        "eval: required: `text: FILE` (genai eval --text), `images: FILE.jsonl` (genai eval --images), or both"
    ]
    with pytest.raises(SpecError) as e:
        read_spec(write(tmp_path, GOOD.replace("eval: {text: heldout.txt, ", f"eval: {{images: {VLM_QUESTIONS}, ")))
    assert str(e.value).split(": ", 1)[1] == "eval.max_tokens: goes with `text: FILE`, which is not given"
