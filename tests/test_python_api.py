"""The Python API: README.md's example, run as it is written, and `genai_pipeline.export` a function
however its module was imported."""

import re
import subprocess
import sys

from conftest import REPO


def readme_example() -> str:
    """The code block of README.md's "Python API" section."""
    section = (REPO / "README.md").read_text().split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


def test_the_readme_example_exports_runs_and_evaluates_the_reference_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "assets").symlink_to(REPO / "assets")  # its paths are relative to the repository
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(readme_example(), "README.md", "exec"), scope)
    exported, reply, scores = scope["exported"], scope["reply"], scope["scores"]
    assert exported.folder.resolve() == (tmp_path / "out" / "reference-8da4w").resolve() and exported.manifest[
        "recipe"
    ].startswith("8da4w")
    assert (
        set(exported.programs.values()) == {exported.folder / "text_decoder.pte"}
        and "verification" in exported.manifest
    )
    assert reply.tokens and capsys.readouterr().out.strip()
    assert scores["perplexity"]["program"] < 1.1 * scores["perplexity"]["float"] and scores["top1_agreement"] > 0.8


def test_export_stays_a_function_beside_its_module():
    code = (
        "from genai_pipeline.export import _export; import genai_pipeline.evaluate.text; import genai_pipeline as g; "
        "print(g.export.__module__, callable(g.export), g.evaluate.__module__, callable(g.evaluate))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["genai_pipeline.export", "True", "genai_pipeline.evaluate", "True"]
