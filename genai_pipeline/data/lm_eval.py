"""The `lm-eval` dataset: documents of an lm-evaluation-harness task, read from a local file.

Calibrating on a task's own documents, formatted as the task shows them to the model, keeps the
quantized model accurate where it will be evaluated. lm-eval itself is not needed: `--calib
lm-eval:PATH` reads the task's data cached as JSON lines (or one JSON array), one document a line.

Caching a task's data (once, while online). The task's YAML in lm-eval's `lm_eval/tasks/<task>/`
names its Hugging Face dataset (`dataset_path`, `dataset_name`) and split (`test_split` or
`validation_split`); save that split with `datasets`:

    python -c "import datasets; datasets.load_dataset('wikitext', 'wikitext-2-raw-v1', split='test').to_json('wikitext.jsonl')"
    python -c "import datasets; datasets.load_dataset('allenai/ai2_arc', 'ARC-Easy', split='validation').to_json('arc_easy.jsonl')"
    python -c "import datasets; datasets.load_dataset('gsm8k', 'main', split='test').to_json('gsm8k.jsonl')"

then `genai ... --calib lm-eval:arc_easy.jsonl`.

Each document becomes one text sample, prompt then answer:

- `text` or `page` (wikitext, lambada): the text itself; blank ones are skipped.
- otherwise the first of `context`, `passage`, `ctx`, `premise`, then the first of `query`,
  `question` (shown as "Question: ...\\nAnswer:"), `goal`, `sentence`, `prompt`, then a space and
  the answer: the first of `answer`, `answers`, `target`, `label`, `gold`, `answerKey`; an index or a
  choice label picks from `choices` / `endings` / `options` (a list, or {"text": [...], "label":
  [...]} as in ARC), a bool reads yes/no, a list (or SQuAD's {"text": [...]}) gives its first item,
  and a string stays as is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from genai_pipeline.data.records import json_records
from genai_pipeline.errors import DataError
from genai_pipeline.messages import Sample, nonempty

TEXT_FIELDS = ("text", "page")
CONTEXT_FIELDS = ("context", "passage", "ctx", "premise")
QUESTION_FIELDS = ("query", "question", "goal", "sentence", "prompt")
ANSWER_FIELDS = ("answer", "answers", "target", "label", "gold", "answerKey")
CHOICE_FIELDS = ("choices", "endings", "options")


def _first(doc: dict, fields: tuple[str, ...]) -> tuple[str | None, Any]:
    return next(((f, doc[f]) for f in fields if doc.get(f) not in (None, "", [])), (None, None))


def _choices(doc: dict) -> tuple[list, list | None]:
    """The answer options, and their labels when the task names options by label (ARC's "A".."D")."""
    _, choices = _first(doc, CHOICE_FIELDS)
    if isinstance(choices, dict):
        return list(choices.get("text") or []), choices.get("label")
    return (choices if isinstance(choices, list) else []), None


def _answer(doc: dict) -> str | None:
    field, value = _first(doc, ANSWER_FIELDS)
    if field is None:
        return None
    choices, labels = _choices(doc)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str) and labels and value in labels:
        value = labels.index(value)
    elif isinstance(value, str) and value.isdigit() and choices:
        value = int(value)
    if isinstance(value, int):
        return str(choices[value]) if 0 <= value < len(choices) else None
    if isinstance(value, dict):  # SQuAD: {"text": [...], "answer_start": [...]}
        value = value.get("text")
    if isinstance(value, list):
        value = value[0] if value else None
    return str(value) if value is not None else None


def render_document(doc: Any, where: str) -> str | None:
    """One task document as prompt + answer text; None for a blank text document."""
    if not isinstance(doc, dict):
        raise DataError(f"{where}: a task document must be a JSON object, got {str(doc)[:60]}")
    field = next((f for f in TEXT_FIELDS if f in doc), None)
    if field is not None:
        text = doc[field]
        if text is not None and not isinstance(text, str):
            raise DataError(f"{where}: '{field}' must be a string, got {type(text).__name__}")
        return text if text and text.strip() else None
    _, context = _first(doc, CONTEXT_FIELDS)
    field, question = _first(doc, QUESTION_FIELDS)
    if context is None and question is None:
        raise DataError(
            f"{where}: no text field found (looked for {', '.join(TEXT_FIELDS + CONTEXT_FIELDS + QUESTION_FIELDS)}; "
            f"the document has {', '.join(doc) or 'none'})"
        )
    if field == "question":
        question = f"Question: {question}\nAnswer:"
    prompt = "\n\n".join(str(p) for p in (context, question) if p is not None)
    answer = _answer(doc)
    return f"{prompt} {answer}" if answer else prompt


def load_lm_eval(path: Path, limit: int | None = None) -> list[Sample]:
    path = Path(path)
    samples = []
    for where, doc in json_records(path):
        if limit is not None and len(samples) >= limit:
            break
        text = render_document(doc, where)
        if text is not None:
            samples.append(Sample(text=text, origin=where))
    return nonempty(samples, f"'{path}'")
