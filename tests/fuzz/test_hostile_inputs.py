"""Hostile inputs end in one clean line: the seeded corpus (GGUFs, templates, images), a property
test over GGUF metadata values, export folders a reader may meet, and the CLI's own arguments."""

import importlib
import json
import math
import signal
import struct
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import corpus  # noqa: E402
from conftest import copy_export  # noqa: E402

from genai_pipeline.cli import main  # noqa: E402
from genai_pipeline.errors import GenAIError  # noqa: E402

CATEGORIES = list(corpus.all_cases())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case of the corpus, fed to the tool in child processes bounded in time and memory."""
    return corpus.outcomes(corpus.all_cases(), tmp_path_factory.mktemp("corpus"))


@pytest.mark.xdist_group("corpus")  # the corpus runs once, on one worker
@pytest.mark.parametrize("category", CATEGORIES)
def test_every_case_is_refused_in_one_line_or_accepted_correctly(results, category):
    rows = results[category]
    assert len(rows) == len(corpus.all_cases()[category])
    bad = [
        f"{r['case']}: {r['outcome']} {r['message'][:200]}" for r in rows if r["outcome"] not in ("accepted", "refused")
    ]
    assert not bad, "\n".join(bad)
    refused = [r for r in rows if r["outcome"] == "refused"]
    assert all(r["message"] and "\n" not in r["message"] for r in refused)
    # the categories where nothing may pass
    if category in ("gguf: truncations", "gguf: lying tensor table", "images: declared sizes"):
        assert len(refused) == len(rows), [r["case"] for r in rows if r["outcome"] != "refused"]
    if category == "templates: hostile":
        # 2 ** 2 ** ... is left-associative in Jinja: 2^32, a fine number
        assert {r["case"] for r in rows if r["outcome"] == "accepted"} <= {"huge power"}


def test_the_corpus_is_what_its_seed_makes():
    """Same seed, same bytes: a failure names a case that can be made again."""
    first, second = corpus.all_cases(), corpus.all_cases()
    assert {c: [n for n, _ in v] for c, v in first.items()} == {c: [n for n, _ in v] for c, v in second.items()}
    assert first["gguf: byte flips in the data"] == second["gguf: byte flips in the data"]


@pytest.mark.parametrize(
    "case", ["cut at 23", "llama.block_count = 1000000000", "offset past the end", "an array declaring 2^40 entries"]
)
def test_the_cli_refuses_a_hostile_gguf_in_one_line_and_keeps_out(capsys, tmp_path, export_tiny, case):
    cases = dict(name_case for cases in corpus.gguf_cases().values() for name_case in cases)
    (tmp_path / "m.gguf").write_bytes(cases[case])
    out = copy_export(export_tiny("kv"), tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(tmp_path / "m.gguf"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if line.startswith("error:")]) == 1 and err[-1].startswith("error: "), err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "out"]


# -- a property over GGUF metadata values --------------------------------------------------------

KEYS = [k for k, kind in corpus.base_metadata().items() if kind[0] in (corpus.U32, corpus.F32)]
VALUES = st.one_of(
    st.integers(0, 2**32 - 1).map(lambda v: (corpus.U32, v)),
    st.integers(-(2**31), 2**31 - 1).map(lambda v: (corpus.I32, v)),
    st.integers(0, 2**64 - 1).map(lambda v: (corpus.U64, v)),
    st.floats(width=32).map(lambda v: (corpus.F32, v)),
    st.floats().map(lambda v: (corpus.F64, v)),
    st.booleans().map(lambda v: (corpus.BOOL, v)),
    st.text(max_size=20).map(lambda v: (corpus.STRING, v)),
    st.lists(st.integers(0, 2**32 - 1), max_size=4).map(lambda v: (corpus.ARRAY, (corpus.U32, v))),
)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(KEYS), value=VALUES)
def test_any_metadata_value_is_refused_in_one_line_or_read_correctly(tmp_path, key, value):
    metadata = corpus.base_metadata()
    metadata[key] = value
    path = tmp_path / "m.gguf"
    path.write_bytes(corpus.gguf_bytes(metadata, corpus.base_tensors(__import__("random").Random(corpus.SEED))))
    previous = signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(corpus.CASE_SECONDS)
    try:
        wrong = corpus.check_gguf(path)
    except GenAIError as e:
        assert "\n" not in str(e)
    else:
        assert wrong is None, wrong
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _timed_out(*_):
    raise AssertionError("a metadata value made loading hang")


# -- export folders ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def damaged_folders(export_tiny, tmp_path_factory):
    """The tiny kv export under each manifest a reader may meet, and with damaged programs."""
    base = export_tiny("kv")
    manifest = json.loads((base / "manifest.json").read_text())
    folders = {}
    for name, value in corpus.manifest_cases(manifest):
        folder = copy_export(base, tmp_path_factory.mktemp("manifest") / "out")
        (folder / "manifest.json").write_text(json.dumps(value))
        folders[f"manifest: {name}"] = folder
    program = (base / "text_decoder.pte").read_bytes()
    for name, at in (
        ("program: header flipped", 12),
        ("program: middle flipped", len(program) // 2),
        ("program: truncated", None),
    ):
        folder = copy_export(base, tmp_path_factory.mktemp("program") / "out")
        data = bytearray(program[: len(program) // 3] if at is None else program)
        if at is not None:
            data[at] ^= 0xFF
        (folder / "text_decoder.pte").write_bytes(bytes(data))
        folders[name] = folder
    folder = copy_export(base, tmp_path_factory.mktemp("tokenizer") / "out")
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"] = {
        token: (i + 1) % len(tokenizer["model"]["vocab"]) for token, i in tokenizer["model"]["vocab"].items()
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))  # another model's: same tokens, other ids
    folders["tokenizer: another model's"] = folder
    return folders


@pytest.mark.xdist_group("damaged-folders")  # built once, on one worker
@pytest.mark.parametrize(
    "command",
    [
        ["run", "--prompt", "x", "--max-new-tokens", "2"],
        ["inspect"],
        ["bench", "--gen-len", "2", "--prompt-len", "2", "--repeats", "1"],
    ],
)
def test_a_damaged_export_folder_is_refused_in_one_line(capsys, damaged_folders, command):
    failures = []
    for name, folder in damaged_folders.items():
        capsys.readouterr()
        code = main([command[0], str(folder), *command[1:]])
        err = capsys.readouterr().err.strip().splitlines()
        if (
            code == 0
            and command[0] != "run"
            and (name.startswith("tokenizer") or "another" in name and command[0] == "inspect")
        ):
            continue  # what the command does not read: inspect describes the program alone, and a bench of random
            # ids reads no tokenizer
        if code != 2 or not err or not err[-1].startswith("error: ") or any("internal error" in line for line in err):
            failures.append(f"{name}: exit {code}, {err[-1:] or 'nothing said'}")
    assert not failures, "\n".join(failures)


# -- the CLI's own arguments ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--temperature", "nan"], "--temperature must be a number >= 0"),
        (["--temperature", "inf"], "--temperature must be a number >= 0"),
        (["--top-p", "nan"], "--top-p must be in (0, 1]"),
        (["--top-k", "-1"], "--top-k must be >= 0"),
    ],
)
def test_sampling_values_outside_their_domain_are_refused(capsys, export_tiny, argv, needle):
    assert main(["run", str(export_tiny("kv")), "--prompt", "x", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_threads_past_the_cores_are_refused(capsys, export_tiny):
    assert main(["bench", str(export_tiny("kv")), "--threads", "100000"]) == 2
    assert "the cores of this machine" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--recipe", "fp32", "--calib", "text:README.md"], "--calib calibrates a quantized recipe"),
        (["--max-seq-len", "1000000000"], "needs a KV cache of"),
    ],
)
def test_export_arguments_that_cannot_work_are_refused_before_any_work(capsys, tmp_path, argv, needle):
    assert main(["export", "reference", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert needle in err.strip().splitlines()[-1] and not (tmp_path / "out").exists()


def test_an_image_declaring_too_many_pixels_is_refused_before_decoding(capsys, tmp_path, monkeypatch):
    from genai_pipeline.errors import InputError
    from genai_pipeline.image_files import read_image

    bombs = dict(corpus.image_cases()["images: declared sizes"])
    (tmp_path / "bomb.png").write_bytes(bombs["png 50000 x 50000"])
    with pytest.raises(
        InputError, match=r"50000 x 50000 = 2,500,000,000 pixels, over the limit of 89,478,485.*GENAI_MAX_IMAGE_PIXELS"
    ):
        read_image(tmp_path / "bomb.png")
    (tmp_path / "ok.png").write_bytes(bombs["png 10000 x 9000"])
    monkeypatch.setenv("GENAI_MAX_IMAGE_PIXELS", "10")
    with pytest.raises(InputError, match="10000 x 9000 = 90,000,000 pixels, over the limit of 10;"):
        read_image(tmp_path / "ok.png")


def test_calibration_json_nested_too_deep_is_one_data_error(tmp_path):
    from genai_pipeline.data.loaders import load_messages
    from genai_pipeline.errors import DataError

    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match="nests JSON too deeply"):
        load_messages(tmp_path / "deep.json")


def test_an_input_file_past_the_size_limit_is_refused_unread(tmp_path, monkeypatch):
    from genai_pipeline.data.records import read_text
    from genai_pipeline.errors import DataError

    (tmp_path / "big.txt").write_text("x" * 1000)
    monkeypatch.setenv("GENAI_MAX_INPUT_BYTES", "999")
    with pytest.raises(DataError, match="1,000 bytes, over the limit of 999; .*GENAI_MAX_INPUT_BYTES"):
        read_text(tmp_path / "big.txt")


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path):
    from genai_pipeline.checkpoints import infer_checkpoint_spec, load_decoder
    from genai_pipeline.errors import CheckpointError

    base = corpus.base_gguf()
    tensors = corpus.base_tensors(__import__("random").Random(corpus.SEED))
    at = len(base) - len(b"".join(t[3] + b"\0" * (-len(t[3]) % 32) for t in tensors)) + 4 * 7  # token_embd's 8th value
    for value in (math.nan, math.inf):
        data = bytearray(base)
        data[at : at + 4] = struct.pack("<f", value)
        (tmp_path / "m.gguf").write_bytes(bytes(data))
        spec, _ = infer_checkpoint_spec(tmp_path / "m.gguf")
        with pytest.raises(CheckpointError, match="tensor tok_embeddings.weight holds NaN or Inf values"):
            load_decoder(spec, tmp_path / "m.gguf", 16)


def test_eval_refuses_to_score_non_finite_logits(tmp_path, export_tiny, monkeypatch):
    """A program whose logits are NaN: eval fails naming it, never 'perplexity nan'."""
    from genai_pipeline.errors import ProgramError

    evaluate_module = importlib.import_module("genai_pipeline.evaluate.text")

    folder = copy_export(export_tiny("kv"), tmp_path / "out")
    (tmp_path / "text.txt").write_text("The list object holds items in order. " * 8)
    session = evaluate_module.open_session
    monkeypatch.setattr(evaluate_module, "open_session", lambda f, **kw: _NaNScores(session(f, **kw)))
    with pytest.raises(
        ProgramError, match="the program in .* gives NaN or Inf logits although its float model does not"
    ):
        evaluate_module.evaluate(
            folder, evaluate_module.EvalOptions(text=tmp_path / "text.txt", max_tokens=32), progress=False
        )


class _NaNScores:
    """A session whose scores are NaN: what a program with a corrupt weight returns."""

    def __init__(self, session):
        self.session = session

    def __getattr__(self, name):
        return getattr(self.session, name)

    def score(self, tokens):
        return self.session.score(tokens) * float("nan")
