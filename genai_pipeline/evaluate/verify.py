"""verify: every quantized export ends measured against its float model.

The program itself (not an eager stand-in) scores a held-out slice of English text: the tail of
the first `text:FILE` calibration file, else the shipped reference model's held-out prose, which
no calibration reads. Top-1 agreement, KL divergence and the perplexity change against the float
model go on one line, into the manifest (`verification`) and the quantization report, and past the
thresholds below a warning says what to try instead: a toy model's near-zero loss says nothing of
a real one's, so nothing a user ships goes unmeasured.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from genai_pipeline.evaluate.text import evaluate
from genai_pipeline.options import EvalOptions

BUILT_IN_TEXT = Path(__file__).resolve().parents[2] / "assets" / "reference" / "heldout.txt"
TOKENS = 256  # enough for the figures to mean something, few enough to cost seconds
WINDOW = 128
TAIL_CHARS = 8000  # the part of a calibration file taken as held out
# Past these a program is visibly worse than its float model (llama.cpp's Q4_0 loses ~20 %
# perplexity on SmolLM2-135M; a broken recipe loses far more).
WARN_PERPLEXITY = 0.25
WARN_TOP1 = 0.75
# What to try instead, by recipe family.
# Under 8da4w, the blocks' linears at 8 bits first: the table, the largest tensor of a small model,
# stays at 4, for most of 8da8w's accuracy at fewer bytes (docs/decisions/0042).
BETTER = {
    "8da4w": "--quant-override '^layers\\.=8da8w' (every block's linears at 8 bits) or --recipe 8da8w",
    "8da8w": "--recipe fp32",
    "8a8w": "--recipe 8da8w",
}


@dataclass(frozen=True)
class Verification:
    text: str  # what was scored
    tokens: int
    perplexity_float: float
    perplexity_program: float
    top1_agreement: float
    kl_divergence: float
    warning: str | None = None

    @property
    def perplexity_change(self) -> float:
        return self.perplexity_program / self.perplexity_float - 1

    def line(self) -> str:
        return (
            f"verified on {self.tokens} tokens of {self.text}: perplexity {self.perplexity_float:.2f} -> "
            f"{self.perplexity_program:.2f} ({100 * self.perplexity_change:+.1f} %), top-1 agreement "
            f"{100 * self.top1_agreement:.1f} %, KL {self.kl_divergence:.4f}"
        )

    def as_manifest(self) -> dict:
        return {**asdict(self), "perplexity_change": round(self.perplexity_change, 5)}


def held_out_text(calibration_files: list[Path]) -> tuple[str, str]:
    """(text, what it is): the tail of the first calibration text file, else the built-in prose."""
    for path in calibration_files:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        if len(text) > 2 * TAIL_CHARS:  # a short file is all calibration; nothing of it is held out
            return text[-TAIL_CHARS:], f"the tail of {Path(path).name}"
    return BUILT_IN_TEXT.read_text(encoding="utf-8")[
        :TAIL_CHARS
    ], "built-in English prose (assets/reference/heldout.txt)"


def verify_export(folder: Path, recipe: str, calibration_files: list[Path]) -> Verification:
    """Score the finished export in `folder` against its float model."""
    text, source = held_out_text(calibration_files)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        result = evaluate(
            Path(folder), EvalOptions(text=Path(f.name), max_tokens=TOKENS, window=WINDOW), progress=False, qdq=False
        )
    perplexity = result["perplexity"]
    measured = Verification(
        text=source,
        tokens=result["tokens"],
        perplexity_float=perplexity["float"],
        perplexity_program=perplexity[result["compared"]],
        top1_agreement=result["top1_agreement"],
        kl_divergence=result["kl_divergence"],
    )
    return Verification(**{**asdict(measured), "warning": warning(measured, recipe)})


def warning(v: Verification, recipe: str) -> str | None:
    if v.perplexity_change <= WARN_PERPLEXITY and v.top1_agreement >= WARN_TOP1:
        return None
    family = recipe.split("+")[0].split("-")[0]
    better = BETTER.get(family, "a recipe with more bits")
    # name what tripped it: a program can agree on too few next tokens with no perplexity lost
    lost = []
    if v.perplexity_change > WARN_PERPLEXITY:
        lost.append(f"{100 * v.perplexity_change:.0f} % perplexity")
    if v.top1_agreement < WARN_TOP1:
        lost.append(f"{100 * (1 - v.top1_agreement):.0f} % of its float model's next tokens")
    return (
        f"this program loses {' and '.join(lost)} against its float model (perplexity "
        f"{100 * v.perplexity_change:+.1f} %, top-1 agreement {100 * v.top1_agreement:.0f} %); try {better}"
    )
