"""The export folder contract: built aside and swapped in whole, files under the user's umask,
--out checked before any work, the checkpoint fingerprinted, the report part of the folder."""

import importlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
from conftest import copy_export

from genai_pipeline.bundle import (
    add_to_manifest,
    atomic_write,
    check_out_folder,
    check_weights,
    publish,
    read_manifest,
    recover_interrupted,
    weights_fingerprint,
)
from genai_pipeline.cli import main
from genai_pipeline.errors import InputError
from genai_pipeline.options import QuantOptions

export_module = importlib.import_module("genai_pipeline.export")  # genai_pipeline.export is the function


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_files_are_written_under_the_users_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        atomic_write(tmp_path / "a.json", "{}")
        atomic_write(tmp_path / "b.bin", lambda f: f.write(b"x"))
    finally:
        os.umask(old)
    assert [stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "a.json", tmp_path / "b.bin")] == [mode, mode]


def _unwritable_parent(tmp_path):
    if os.geteuid() != 0:
        parent = tmp_path / "ro"
        parent.mkdir(mode=0o555)
        return parent / "out"
    if not os.path.isdir("/sys"):
        pytest.skip("root writes anywhere but /sys")
    return "/sys/genai-out"  # root may write everywhere but here


@pytest.mark.parametrize("case", ["file", "under a file", "unwritable parent"])
def test_an_out_that_cannot_be_written_is_refused_before_any_work(capsys, monkeypatch, tmp_path, case):
    (tmp_path / "file").write_text("not a folder")
    out = {
        "file": tmp_path / "file",
        "under a file": tmp_path / "file" / "out",
        "unwritable parent": _unwritable_parent(tmp_path),
    }[case]
    monkeypatch.setattr(export_module, "_export", lambda *a: pytest.fail("the export started"))
    assert main(["export", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: --out '{out}'"), err
    assert (tmp_path / "file").read_text() == "not a folder"


def _tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def _checkpoints(tmp_path):
    """An HF checkpoint folder and a folder holding a GGUF beside other files; nothing is loaded:
    --out is checked before any work."""
    hf = tmp_path / "models" / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (hf / "model.safetensors").write_bytes(os.urandom(64))
    gguf = tmp_path / "downloads" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + os.urandom(60))
    (gguf.parent / "holiday.jpg").write_bytes(os.urandom(32))
    return hf, gguf


@pytest.mark.parametrize(
    "case",
    [
        "checkpoint folder",
        "its parent",
        "its grandparent",
        "folder of a gguf",
        "parent of a gguf's folder",
        "relative path to the checkpoint",
    ],
)
def test_an_out_holding_the_checkpoint_is_refused_and_the_checkpoint_kept(capsys, monkeypatch, tmp_path, case):
    hf, gguf = _checkpoints(tmp_path)
    checkpoint, out = {
        "checkpoint folder": (hf, hf),
        "its parent": (hf, hf.parent),
        "its grandparent": (hf, tmp_path),
        "folder of a gguf": (gguf, gguf.parent),
        "parent of a gguf's folder": (gguf, tmp_path),
        "relative path to the checkpoint": (hf, "../hf"),
    }[case]
    monkeypatch.chdir(hf.parent / "hf" if case.startswith("relative") else tmp_path)
    before = _tree(tmp_path)
    monkeypatch.setattr(export_module, "_export", lambda *a: pytest.fail("the export started"))
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "holds the checkpoint" in err, err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize(
    "case",
    [
        "files and no manifest",
        "a manifest not ours",
        "a manifest that is a list",
        "our export and a foreign file",
        "our export and a foreign folder",
    ],
)
def test_an_out_that_is_not_only_our_export_is_refused_untouched(capsys, monkeypatch, tmp_path, export_tiny, case):
    out = tmp_path / "out"
    if case.startswith("our export"):
        copy_export(export_tiny("kv"), out)
        if case.endswith("file"):
            (out / "notes.txt").write_text("mine")
        else:
            (out / ".git").mkdir()
            (out / ".git" / "HEAD").write_text("ref: refs/heads/main")
    else:
        out.mkdir()
        (out / "thesis.tex").write_text("years of work")
        manifest = {"a manifest not ours": '{"files": {}}', "a manifest that is a list": "[1, 2]"}.get(case)
        if manifest:
            (out / "manifest.json").write_text(manifest)
    capsys.readouterr()  # the session's export, if this test built it
    before = _tree(tmp_path)
    monkeypatch.setattr(export_module, "_export", lambda *a: pytest.fail("the export started"))
    assert main(["export", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: --out '{out}'"), err
    assert ("not part of its export" if case.startswith("our export") else "not an export of genai") in err
    assert _tree(tmp_path) == before


def test_an_absent_or_empty_out_or_one_of_our_exports_is_accepted(tmp_path, export_tiny):
    (tmp_path / "empty").mkdir()
    ours = copy_export(export_tiny("kv"), tmp_path / "ours")
    for out in (tmp_path / "absent", tmp_path / "empty", ours):
        check_out_folder(out, None)


_KILLED_WHILE_PUBLISHING = textwrap.dedent("""
    import os, pathlib, shutil, signal, sys
    from genai_pipeline import bundle
    out, where = pathlib.Path(sys.argv[1]), sys.argv[2]
    staging = bundle.make_staging_folder(out)
    (staging / "manifest.json").write_text("new")
    kill = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    if where != "after the exchange":
        bundle._exchange = lambda a, b: False  # a system without renameat2: two renames
    if where == "between the renames":
        rename = pathlib.Path.rename
        pathlib.Path.rename = lambda self, to: (rename(self, to), setattr(pathlib.Path, "rename", kill))[0]
    else:
        shutil.rmtree = kill  # the old export is in place to be removed
    bundle.publish(staging, out)
""")


@pytest.mark.parametrize(
    "where, then", [("after the exchange", "new"), ("between the renames", "old"), ("after the renames", "new")]
)
def test_a_kill_while_publishing_leaves_the_old_or_the_new_export(tmp_path, where, then):
    """SIGKILL at each step of publish: `out` is whole (the exchange), or put back whole by the next
    command that touches it; nothing is left beside it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text("old")
    child = subprocess.run([sys.executable, "-c", _KILLED_WHILE_PUBLISHING, str(out), where], capture_output=True)
    assert child.returncode == -signal.SIGKILL, child.stderr
    if where == "after the exchange":
        assert (out / "manifest.json").read_text() == "new"  # whole at once: there was no moment without it
    assert len(list(tmp_path.iterdir())) == 2  # out (or not), and the folder the kill left beside it
    recover_interrupted(out)
    assert (out / "manifest.json").read_text() == then
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_publish_exchanges_the_folders_in_one_step(tmp_path):
    out, staging = tmp_path / "out", tmp_path / ".out.staging-1"
    out.mkdir()
    staging.mkdir()
    (out / "f").write_text("old")
    (staging / "f").write_text("new")
    inode = out.stat().st_ino
    publish(staging, out)
    assert (out / "f").read_text() == "new" and not staging.exists()
    if sys.platform == "linux":
        assert out.stat().st_ino != inode  # the staging folder itself took the name, in one exchange


def test_an_export_replaces_the_previous_one_whole(tmp_path, tiny_checkpoint, export_tiny):
    """A dynamic-recipe export into a folder holding a float export plus leftovers: nothing of
    the old folder survives, the manifest lists exactly what is there, the report included, and
    no calibration warning is given (nothing was calibrated)."""
    out = copy_export(export_tiny("kv"), tmp_path / "out")
    for stray in ("quant_report.html", "text_decoder.qdq.pt2", "notes.txt"):  # files of an earlier export, listed
        (out / stray).write_text("from an earlier export")
        add_to_manifest(out, stray)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "genai_pipeline.cli",
            "export",
            "--checkpoint",
            str(tiny_checkpoint),
            "--mode",
            "kv",
            "--max-seq-len",
            "32",
            "--recipe",
            "8da8w",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=lambda: os.umask(0o022),
    )
    assert result.returncode == 0, result.stderr
    assert "RANDOM" not in result.stderr
    manifest = read_manifest(out)
    names = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    assert names == sorted([*manifest["files"], "manifest.json"])
    assert "notes.txt" not in names and "text_decoder.qdq.pt2" not in names and "quant_report.html" in names
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or set-aside folder left
    report = (out / "quant_report.html").read_text()
    assert "nothing was calibrated" in report and "from an earlier export" not in report
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in out.iterdir() if not p.name.startswith(".")} == {
        name: "0o644" for name in names
    }
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert manifest["checkpoint"]["path"] == str(tiny_checkpoint.resolve())
    assert set(manifest["checkpoint"]["files"]) == {"model.safetensors"}


def test_a_failed_export_leaves_the_previous_one_intact(capsys, tmp_path, export_tiny):
    from conftest import save_hf_checkpoint

    out = copy_export(export_tiny("kv"), tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    checkpoint = save_hf_checkpoint(tmp_path / "ckpt")
    (checkpoint / "model.safetensors").write_bytes(b"\x00" * 64)
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == 2
    assert "model.safetensors" in capsys.readouterr().err.strip().splitlines()[-1]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]  # its staging folder is gone


def test_eval_and_report_refuse_weights_changed_since_the_export(capsys, tmp_path, tiny_checkpoint, export_tiny):
    from genai_pipeline.evaluate.report import write_quant_report

    checkpoint = shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")
    folder = copy_export(export_tiny("kv"), tmp_path / "export")
    manifest = read_manifest(folder)
    manifest["checkpoint"]["path"] = str(checkpoint)  # the same bytes with new modification times
    (folder / "manifest.json").write_text(json.dumps(manifest))
    check_weights(manifest)  # a copy or a `touch` is not a change: the sha256 settles it
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)  # same size, other values
    weights.write_bytes(bytes(data))
    text = tmp_path / "text.txt"
    text.write_text("The list object has methods. " * 4)
    assert main(["eval", str(folder), "--text", str(text)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and err[0] == f"error: the checkpoint's weight file {weights} changed since the export; re-export"
    )
    with pytest.raises(InputError, match="changed since the export"):
        write_quant_report(folder, [1, 2, 3], "test tokens")
    assert (
        weights_fingerprint(checkpoint)["files"]["model.safetensors"]["sha256"]
        != manifest["checkpoint"]["files"]["model.safetensors"]["sha256"]
    )


def test_the_qdq_reuse_key_includes_the_tool_versions(monkeypatch, tiny_checkpoint):
    from genai_pipeline.bundle import tool_versions
    from genai_pipeline.options import PrepareOptions
    from genai_pipeline.prepare import prepare
    from genai_pipeline.quantize import static
    from genai_pipeline.registry import get_spec

    prepared = prepare(
        get_spec("smollm2-135m"), PrepareOptions(max_seq_len=32, prefill_len=8, checkpoint=tiny_checkpoint)
    )
    options = QuantOptions(recipe="8a8w")
    key = static.qdq_key(prepared, options, "xnnpack")
    assert static.qdq_key(prepared, options, "xnnpack") == key
    for tool in ("genai_pipeline", "torch", "executorch", "torchao"):
        monkeypatch.setattr(static, "tool_versions", lambda tool=tool: {**tool_versions(), tool: "0.0.1"})
        assert static.qdq_key(prepared, options, "xnnpack") != key, tool
