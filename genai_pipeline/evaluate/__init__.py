"""evaluate: how far an export is from its float model.

text.py     genai eval --text: perplexity, top-1 agreement and KL of the program against float
images.py   genai eval --images: a vision-language program's answers to held-out questions
verify.py   the check `genai export` runs on every quantized program
report.py   the per-layer SQNR report written beside a quantized export
"""

from genai_pipeline.evaluate.images import evaluate_images
from genai_pipeline.evaluate.text import evaluate

__all__ = ["evaluate", "evaluate_images"]
