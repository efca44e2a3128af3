"""options.py, every user-facing option, is torch-free: the CLI's parser and the Python API read it
without loading torch (seconds), and it imports nothing of the package but errors, names and
layer_rules (the rules a recipe is made of, as torch-free)."""

import subprocess
import sys


def _imported_after(statement: str) -> list[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def test_options_import_no_torch_and_only_errors_names_and_layer_rules():
    modules = _imported_after("import genai_pipeline.options")
    assert not {m.split(".")[0] for m in modules} & {"torch", "executorch", "torchao", "numpy", "transformers"}
    ours = {m for m in modules if m.startswith("genai_pipeline")}
    leaves = {"genai_pipeline.errors", "genai_pipeline.names", "genai_pipeline.layer_rules"}
    assert ours <= {"genai_pipeline", "genai_pipeline.options", *leaves}, ours


def test_the_package_imports_no_torch_until_a_function_is_used():
    modules = _imported_after("import genai_pipeline; genai_pipeline.QuantOptions(recipe='8da4w')")
    assert not {m.split(".")[0] for m in modules} & {"torch", "executorch", "torchao", "numpy", "transformers"}
