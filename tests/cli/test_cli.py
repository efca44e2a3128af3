"""The `genai` command: what users see, and one clear line for every kind of bad input."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import TINY_MAX_SEQ, copy_export, save_hf_checkpoint

from genai_pipeline import cli
from genai_pipeline.cli import main, one_openmp_thread_per_caller
from genai_pipeline.errors import ExportError


def genai(*args, timeout=600):
    """The real entry point in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "genai_pipeline.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def fails_with_one_line(capsys, argv, *needles):
    """In-process `main`: non-zero exit, and stderr ends with one `error:` line naming the problem."""
    assert main([str(a) for a in argv]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: "), err
    for needle in needles:
        assert needle in last, last
    return last


def test_genai_debug_shows_what_an_error_line_hides(capsys, monkeypatch):
    """An error that wraps a failure deep inside torch stays one line; GENAI_DEBUG=1 adds the
    wrapped failure's traceback above it."""

    def lowering_fails(args):
        try:
            raise AttributeError("`rotate_half` is not a buffer")
        except AttributeError as e:
            raise ExportError("lowering text_decoder to xnnpack failed") from e

    monkeypatch.setattr(cli, "cmd_models", lowering_fails)
    fails_with_one_line(capsys, ["models"], "lowering text_decoder to xnnpack failed")
    monkeypatch.setenv("GENAI_DEBUG", "1")
    assert main(["models"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "in lowering_fails" in err and "is not a buffer" in err
    assert err.strip().splitlines()[-1] == "error: lowering text_decoder to xnnpack failed"


def test_models_lists_the_registry(capsys):
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert {"reference", "smollm2-135m", "llama3_2-1b"} <= set(rows)
    assert rows["reference"]["default"] and 1e6 < rows["reference"]["params"] <= 10e6
    assert 134e6 < rows["smollm2-135m"]["params"] < 135e6


def test_unknown_model_lists_known_names(tmp_path):
    result = genai("export", "llama-9000", "--out", tmp_path)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: unknown model 'llama-9000'")
    assert "smollm2-135m" in result.stderr and "reference" in result.stderr


def test_missing_checkpoint_folder(capsys, tmp_path):
    fails_with_one_line(
        capsys, ["export", "smollm2-135m", "--checkpoint", tmp_path / "nope", "--out", tmp_path / "o"], "does not exist"
    )


def test_corrupt_checkpoint_folder(capsys, tmp_path):
    folder = save_hf_checkpoint(tmp_path / "ckpt")
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    fails_with_one_line(capsys, ["export", "--checkpoint", folder, "--out", tmp_path / "o"], "model.safetensors")
    assert not (tmp_path / "o" / "text_decoder.pte").exists()


def test_shape_mismatch_names_the_tensor(capsys, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    folder = save_hf_checkpoint(tmp_path / "ckpt")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    fails_with_one_line(capsys, ["export", "--checkpoint", folder, "--out", tmp_path / "o"], "model.norm.weight")


def test_unsupported_recipe_is_refused_before_work(capsys, tmp_path):
    out = tmp_path / "o"
    fails_with_one_line(
        capsys, ["export", "--target", "portable", "--recipe", "8da4w", "--out", out], "does not support recipe '8da4w'"
    )
    fails_with_one_line(capsys, ["export", "--target", "portable", "--embedding", "8w", "--out", out], "--embedding 8w")
    fails_with_one_line(capsys, ["export", "--recipe", "3da1w", "--out", out], "unknown recipe '3da1w'")
    fails_with_one_line(capsys, ["export", "--quant-override", "output", "--out", out], "REGEX=RECIPE")
    assert not out.exists()


def test_export_infers_the_entry_from_config(capsys, tmp_path, export_tiny):
    folder = save_hf_checkpoint(tmp_path / "ckpt", model_type="qwen3", head_dim=16)
    from genai_pipeline.checkpoints.hf import read_config
    from genai_pipeline.registry import infer_spec

    spec = infer_spec(read_config(folder))  # sizes of no entry: the family under a name that says so
    assert spec.name == "qwen3 (custom: 2 layers, dim 64)" and spec.entry == "qwen3-0_6b" and spec.config.head_dim == 16
    (folder / "config.json").write_text(json.dumps({**read_config(folder), "model_type": "mamba"}))
    fails_with_one_line(
        capsys, ["export", "--checkpoint", folder, "--out", tmp_path / "o"], "model_type 'mamba'", "qwen3"
    )


def test_run_streams_text_and_reports_json(capsys, export_tiny):
    folder = export_tiny("hybrid")
    assert main(["run", str(folder), "--prompt", "The list object", "--max-new-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["tokens"]) == 12 and out["prompt_tokens"][0] == 0  # BOS first
    assert out["decode_tokens_per_s"] > 0 and out["prefill_tokens_per_s"] > 0
    assert main(["run", str(folder), "--prompt", "The list object", "--max-new-tokens", "12"]) == 0
    streamed = capsys.readouterr().out
    assert streamed.strip() == out["text"].strip()


def test_prompt_longer_than_context(capsys, export_tiny):
    fails_with_one_line(capsys, ["run", export_tiny("hybrid"), "--prompt", "word " * (TINY_MAX_SEQ + 5)], "context")


def test_run_on_missing_folder(capsys, tmp_path):
    fails_with_one_line(capsys, ["run", tmp_path / "nope", "--prompt", "x"], "does not exist")


def test_run_on_truncated_program(capsys, tmp_path, export_tiny):
    folder = copy_export(export_tiny("hybrid"), tmp_path / "copy")
    pte = folder / "text_decoder.pte"
    pte.write_bytes(pte.read_bytes()[: pte.stat().st_size // 2])
    fails_with_one_line(capsys, ["run", folder, "--prompt", "x"], "truncated")


def test_run_on_corrupt_program_of_the_right_size(tmp_path, export_tiny):
    folder = copy_export(export_tiny("hybrid"), tmp_path / "copy")
    pte = folder / "text_decoder.pte"
    data = bytearray(pte.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    pte.write_bytes(bytes(data))
    result = genai("run", folder, "--prompt", "x")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "corrupt" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("damage", ["missing", "truncated", "garbage"])
def test_inspect_bad_files(capsys, tmp_path, export_tiny, damage):
    pte = tmp_path / "x.pte"
    good = (export_tiny("hybrid") / "text_decoder.pte").read_bytes()
    if damage == "truncated":
        pte.write_bytes(good[:4096])
    elif damage == "garbage":
        pte.write_bytes(os.urandom(4096))
    fails_with_one_line(capsys, ["inspect", pte], str(pte))


def _export_stopped_while_lowering(out, tiny_checkpoint, sig):
    """`genai export` into `out` in a child process, sent `sig` once it exports its first graph
    (lowering a tiny model can finish before a signal sent at "lower" arrives)."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "genai_pipeline.cli",
            "export",
            "--checkpoint",
            tiny_checkpoint,
            "--mode",
            "hybrid",
            "--max-seq-len",
            "64",
            "--out",
            out,
        ],
        stderr=subprocess.PIPE,
        # A job a non-interactive shell starts in the background ignores SIGINT, and a Python
        # started that way keeps ignoring it: give the child the default, as a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen, deadline = b"", time.time() + 300
    while b"export text_decoder" not in seen and time.time() < deadline:
        chunk = os.read(child.stderr.fileno(), 4096)
        if not chunk:
            break
        seen += chunk
    assert b"export text_decoder" in seen, seen.decode(errors="replace")
    child.send_signal(sig)
    seen += child.stderr.read()
    return child.wait(), seen.decode(errors="replace"), child.pid


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_an_interrupted_export_leaves_the_previous_one_intact(tmp_path, tiny_checkpoint, export_tiny, sig):
    out = copy_export(export_tiny("kv"), tmp_path / "out")  # a complete earlier export in the same folder
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rc, err, pid = _export_stopped_while_lowering(out, tiny_checkpoint, sig)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    staging = tmp_path / f".out.staging-{pid}"
    if (
        sig != signal.SIGKILL
    ):  # KeyboardInterrupt, or SIGTERM raised as one: one line, and the staging folder is removed
        assert rc == 130 and err.strip().splitlines()[-1] == "error: interrupted", err
        assert not staging.exists()
    else:  # killed outright: its staging folder stays until the next command that reads or writes --out
        assert staging.is_dir()
    result = genai("run", out, "--prompt", "x", "--max-new-tokens", "2")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_inspect_json_describes_a_hybrid_program(export_tiny):
    result = genai("inspect", export_tiny("hybrid") / "text_decoder.pte", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["methods"]) == {"prefill", "prefill_chunk", "decode_token"}
    prefill, decode = report["methods"]["prefill_chunk"], report["methods"]["decode_token"]
    assert [i["shape"] for i in prefill["inputs"]] == [[1, 8], [1]]
    assert [i["shape"] for i in report["methods"]["prefill"]["inputs"]] == [[1, 32], [1]]
    assert report["methods"]["prefill"]["inputs"][0]["dynamic"]  # 1 to 32 tokens
    assert not any("dynamic" in i for i in prefill["inputs"] + decode["inputs"])
    assert [i["shape"] for i in decode["inputs"]] == [[1, 1], [1]]
    assert prefill["outputs"][0]["shape"] == decode["outputs"][0]["shape"] == [1, 384]  # the next token's logits
    assert prefill["delegates"]["XnnpackBackend"] > 0
    assert report["named_data"]["bytes"] > 0 and report["named_data"]["shared_bytes"] == report["named_data"]["bytes"]
    buffers = report["mutable_buffers"]
    assert len(buffers) == 4 and all(b["shared"] for b in buffers.values())  # k and v, two layers
    # ExecuTorch's runners: the cache's length, and the most tokens one `prefill` call takes
    assert report["metadata"]["get_max_context_len"] == TINY_MAX_SEQ and report["metadata"]["get_max_seq_len"] == 32
    assert report["metadata"]["use_kv_cache"] is True and report["metadata"]["enable_dynamic_shape"] is True
    assert report["metadata"]["get_prefill_len"] == 8
    assert report["stock_runners"] == {"TextLLMRunner": None, "MultimodalRunner": "no `token_embedding` method"}


def test_inspect_portable_program_has_no_delegates(capsys, export_tiny):
    assert main(["inspect", str(export_tiny("dynamic", "portable") / "text_decoder.pte"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["methods"]["forward"]["delegates"] == {}
    assert report["metadata"]["enable_dynamic_shape"] is True


# ChatML's shape with the tiny tokenizer's only special token, <|endoftext|>, ending each turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant\\n' }}{% endif %}"
)


def chat_folder(export_tiny, dest, template=CHAT_TEMPLATE):
    folder = copy_export(export_tiny("hybrid"), dest)
    (folder / "chat_template.jinja").write_text(template)
    specials = {"bos_token": "<|endoftext|>", "eos_token": {"content": "<|endoftext|>"}}
    (folder / "tokenizer_config.json").write_text(json.dumps(specials))
    return folder


def test_run_chat_converses_on_stdin(capsys, monkeypatch, tmp_path, export_tiny):
    import io

    from genai_pipeline.chat_template import read_chat_template
    from genai_pipeline.options import SamplingOptions
    from genai_pipeline.runtime.chat import Chat, end_of_turn_ids
    from genai_pipeline.runtime.generate import Sampler
    from genai_pipeline.runtime.session import DecoderSession
    from genai_pipeline.tokenizer import Tokenizer

    folder = chat_folder(export_tiny, tmp_path / "chat")
    session, tokenizer, template = (
        DecoderSession(folder),
        Tokenizer(folder / "tokenizer.json"),
        read_chat_template(folder),
    )
    chat = Chat(
        session, tokenizer, template, Sampler(SamplingOptions()), end_of_turn_ids(folder, tokenizer, [0], template), 8
    )
    first, second = chat.send("Hi").text, chat.send("And a list?").text
    assert first != second

    # --prompt is the first turn; a turn that does not fit is refused and the chat goes on; /exit ends it
    stdin = "And a list?\n" + "word " * TINY_MAX_SEQ + "\n/reset\nHi\n/exit\nHi\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert main(["run", str(folder), "--chat", "--prompt", "Hi", "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{first}\n{second}\n{first}\n"  # after /reset, "Hi" is answered as at the start
    full = [line for line in err.splitlines() if "context" in line]
    assert len(full) == 1 and f"the program's context is {TINY_MAX_SEQ}" in full[0] and "--max-seq-len" in full[0]
    assert "conversation cleared" in err


def test_run_chat_bad_input(capsys, monkeypatch, tmp_path, export_tiny):
    import io

    fails_with_one_line(capsys, ["run", export_tiny("hybrid")], "--prompt TEXT is required", "--chat")
    fails_with_one_line(
        capsys, ["run", export_tiny("hybrid"), "--prompt", "x", "--system", "Be brief."], "--system needs --chat"
    )
    untemplated = copy_export(export_tiny("hybrid"), tmp_path / "untemplated")
    (untemplated / "chat_template.jinja").unlink()  # the registry's fallback, written by the export
    fails_with_one_line(capsys, ["run", untemplated, "--chat"], "no chat template", "chat_template.jinja")
    refusing = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    folder = chat_folder(export_tiny, tmp_path / "refusing", refusing + CHAT_TEMPLATE)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    fails_with_one_line(
        capsys, ["run", folder, "--chat", "--system", "Be brief."], "System role not supported", "chat_template.jinja"
    )


@pytest.mark.parametrize(
    "argv, expected", [(["bench", "x"], "1"), (["run", "x"], "1"), (["export", "x"], None), (["eval", "x"], None)]
)
def test_program_timing_commands_run_one_openmp_thread_per_caller(monkeypatch, argv, expected):
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # so that monkeypatch restores the variable afterwards
    monkeypatch.delenv("OMP_NUM_THREADS")
    one_openmp_thread_per_caller(argv)
    assert os.environ.get("OMP_NUM_THREADS") == expected


def test_a_users_openmp_setting_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    one_openmp_thread_per_caller(["bench", "x"])
    assert os.environ["OMP_NUM_THREADS"] == "2"


def test_main_in_process_leaves_the_packages_log_records_to_the_caller(caplog, capsys):
    # main() routes the package's logger to its own stderr handler for the call; afterwards a caller
    # in the same process (a test's caplog) must see the records again, whichever test ran main first.
    import logging

    assert main(["models"]) == 0
    with caplog.at_level(logging.INFO, logger="genai_pipeline.data.collate"):
        logging.getLogger("genai_pipeline.data.collate").info("after main")
    assert "after main" in caplog.text


def test_serve_refuses_what_it_cannot_serve_in_one_line(capsys, monkeypatch, export_reference_vlm, tmp_path):
    fails_with_one_line(capsys, ["serve", export_reference_vlm, "--parallel", "0"], "--parallel must be at least 1")
    fails_with_one_line(
        capsys, ["serve", export_reference_vlm, "--lookahead", "4"], "--lookahead needs", "--verify-len"
    )
    fails_with_one_line(capsys, ["serve", tmp_path / "absent"], "absent")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        fails_with_one_line(
            capsys, ["serve", export_reference_vlm, "--port", port], f"cannot listen on 127.0.0.1:{port}"
        )
    monkeypatch.setenv("GENAI_MAX_QUEUED_REQUESTS", "many")
    fails_with_one_line(capsys, ["serve", export_reference_vlm], "GENAI_MAX_QUEUED_REQUESTS must be a whole number")
