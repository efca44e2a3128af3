"""`--calib NAME:ARG` parsing and the validation of CalibrationOptions."""

import pytest

from genai_pipeline.errors import DataError, GenAIError, InputError
from genai_pipeline.options import DATASET_KINDS, CalibrationOptions, DatasetSpec, parse_dataset


def test_parse_name_and_argument():
    assert parse_dataset("text:corpus.txt") == DatasetSpec("text", "corpus.txt")
    assert parse_dataset("hf-chat:data/chat:v2") == DatasetSpec("hf-chat", "data/chat:v2")  # split at the first ':'
    assert str(parse_dataset("lm-eval:arc.jsonl").path) == "arc.jsonl"


def test_random_takes_no_argument():
    assert parse_dataset("random") == parse_dataset("random:") == DatasetSpec("random", None)
    with pytest.raises(DataError, match="takes no argument.*--calib-limit"):
        parse_dataset("random:16")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(DataError) as e:
        parse_dataset("wikipedia:enwiki.txt")
    assert isinstance(e.value, GenAIError)
    message = str(e.value)
    assert "'wikipedia'" in message and all(kind in message for kind in DATASET_KINDS)


@pytest.mark.parametrize("kind", ["text", "messages", "hf-chat", "lm-eval"])
def test_file_datasets_need_an_argument(kind):
    with pytest.raises(DataError, match=f"'{kind}' needs .*--calib {kind}:PATH"):
        parse_dataset(kind)


def test_options_take_specs_or_strings_in_order():
    options = CalibrationOptions(datasets=["text:a.txt", DatasetSpec("random")], limit=4, seq_len=64)
    assert options.datasets == (DatasetSpec("text", "a.txt"), DatasetSpec("random"))
    assert CalibrationOptions().datasets == () and CalibrationOptions().seq_len == 128
    assert CalibrationOptions(datasets="random").datasets == (DatasetSpec("random"),)  # one spec, not its letters


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"limit": 0}, "--calib-limit must be at least 1, got 0"),
        ({"seq_len": 0}, "--calib-seq-len must be at least 1, got 0"),
    ],
)
def test_bad_option_values(kwargs, problem):
    with pytest.raises(InputError) as e:
        CalibrationOptions(**kwargs)
    assert problem in str(e.value)
