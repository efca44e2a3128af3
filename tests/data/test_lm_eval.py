"""`lm-eval`: a task's documents cached as JSON lines, rendered as prompt + answer text."""

import json

import pytest

from genai_pipeline.data import load_dataset
from genai_pipeline.data.lm_eval import load_lm_eval, render_document
from genai_pipeline.errors import DataError
from genai_pipeline.options import DatasetSpec


def _jsonl(path, docs):
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def test_wikitext_style_task_built_from_local_text(tmp_path):
    """As `load_dataset('wikitext', ...).to_json(...)` writes it: one `text` row per line, many blank."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    docs = []
    for name in sorted(topics)[:5]:
        docs += [{"text": ""}, {"text": f" = {name} = \n"}, {"text": topics[name][:300]}]
    samples = load_dataset(DatasetSpec("lm-eval", str(_jsonl(tmp_path / "wikitext.jsonl", docs))))
    assert len(samples) == 10
    assert samples[0].text == f" = {sorted(topics)[0]} = \n" and samples[1].text == topics[sorted(topics)[0]][:300]
    assert samples[0].origin.endswith("line 2")
    assert len(load_lm_eval(tmp_path / "wikitext.jsonl", limit=3)) == 3


@pytest.mark.parametrize(
    "doc, text",
    [
        (  # ARC: choices by label
            {
                "question": "Which is a mammal?",
                "choices": {"text": ["trout", "whale"], "label": ["A", "B"]},
                "answerKey": "B",
            },
            "Question: Which is a mammal?\nAnswer: whale",
        ),
        ({"question": "2+2?", "choices": ["3", "4", "5"], "answer": 1}, "Question: 2+2?\nAnswer: 4"),  # MMLU
        (
            {"question": "Half of 8?", "answer": "8 / 2 = 4\n#### 4"},
            "Question: Half of 8?\nAnswer: 8 / 2 = 4\n#### 4",
        ),  # GSM8K
        (
            {"ctx": "She opens the door and", "endings": ["flies.", "walks in."], "label": "1"},
            "She opens the door and walks in.",
        ),
        (
            {"passage": "Water is wet.", "question": "is water wet", "answer": True},
            "Water is wet.\n\nQuestion: is water wet\nAnswer: yes",
        ),
        ({"query": "Q: Capital of France?\nA:", "gold": ["Paris", "paris"]}, "Q: Capital of France?\nA: Paris"),
        ({"goal": "Open a jar", "label": 0}, "Open a jar"),  # an index with no choices: prompt only
        (
            {"context": "Ottawa is in Canada.", "question": "Where is Ottawa?", "answers": {"text": ["Canada"]}},
            "Ottawa is in Canada.\n\nQuestion: Where is Ottawa?\nAnswer: Canada",
        ),  # SQuAD
    ],
)
def test_documents_render_as_prompt_and_answer(doc, text):
    assert render_document(doc, "doc") == text


def test_a_json_array_file_and_its_limit(tmp_path):
    f = tmp_path / "task.json"
    f.write_text(json.dumps([{"question": f"q{i}", "answer": f"a{i}"} for i in range(4)]))
    assert [s.text for s in load_lm_eval(f, limit=2)] == ["Question: q0\nAnswer: a0", "Question: q1\nAnswer: a1"]


def test_unknown_document_layout_names_its_fields(tmp_path):
    f = _jsonl(tmp_path / "task.jsonl", [{"text": "ok"}, {"image": "x.png", "caption_id": 3}])
    with pytest.raises(DataError) as e:
        load_lm_eval(f)
    message = str(e.value)
    assert "line 2" in message and "no text field" in message and "image, caption_id" in message


def test_non_object_document(tmp_path):
    with pytest.raises(DataError, match="must be a JSON object"):
        load_lm_eval(_jsonl(tmp_path / "task.jsonl", [["a", "b"]]))


def test_only_blank_documents_is_an_empty_dataset(tmp_path):
    with pytest.raises(DataError, match="holds no samples"):
        load_lm_eval(_jsonl(tmp_path / "task.jsonl", [{"text": ""}, {"text": "\n"}]))


def test_missing_task_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_lm_eval(tmp_path / "arc_easy.jsonl")
