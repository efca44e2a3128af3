"""heap: tensors' bytes moved to a memory-mapped file, values and views unchanged; their pages given back."""

import torch

from genai_pipeline import heap
from genai_pipeline.heap import move_to_file, page_out


def mappings_of(name: str) -> list[str]:
    return [line for line in open("/proc/self/maps") if name in line]


def test_moved_tensors_keep_their_values_and_views_and_read_from_the_file(tmp_path):
    table = torch.randn(1000, 300)
    rows = table[10:20]  # a view: it must still see the table's bytes
    ints = torch.randint(-8, 8, (512, 700), dtype=torch.int8)
    halves = torch.randn(200, 512).bfloat16()
    empty = torch.randn(0)
    want = [t.clone() for t in (table, rows, ints, halves, empty)]

    moved = move_to_file([table, rows, ints, halves, empty], tmp_path / "weights")

    assert moved >= table.nbytes + ints.nbytes + halves.nbytes
    assert all(torch.equal(t, w) for t, w in zip((table, rows, ints, halves, empty), want))
    assert not (tmp_path / "weights").exists()  # unlinked at once: nothing to clean up after a crash
    # one private mapping of the deleted file per storage, of the storage's size: ExecuTorch's
    # serializers read a weight's whole storage
    assert len(mappings_of(str(tmp_path / "weights"))) == 3
    assert rows.untyped_storage().data_ptr() == table.untyped_storage().data_ptr()
    assert [t.untyped_storage().nbytes() for t in (table, ints, halves)] == [t.nbytes for t in (table, ints, halves)]
    table[11, 0] = 5.0  # copy on write, and the view still shares the table's bytes
    assert rows[1, 0].item() == 5.0


def test_what_is_in_a_file_already_stays_there(tmp_path):
    first = torch.randn(256, 256)
    assert move_to_file([first], tmp_path / "a") == first.nbytes
    where = first.data_ptr()
    second = torch.randn(256, 256)
    assert move_to_file([first, second], tmp_path / "b") == second.nbytes
    assert first.data_ptr() == where and len(mappings_of(str(tmp_path))) == 2


def test_nothing_to_move_leaves_no_file(tmp_path):
    assert move_to_file([torch.randn(0)], tmp_path / "weights") == 0
    assert not (tmp_path / "weights").exists()


def rss_file_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_serialized_checkpoint_pages_are_given_back(tmp_path):
    """Lowering pages out a partition's memory-mapped weights once XNNPACK has serialized them;
    what is read again afterwards comes back from the file unchanged."""
    from safetensors.torch import load_file, save_file

    weights = torch.randn(64, 2**18)  # 64 MB
    save_file({"w": weights}, tmp_path / "w.safetensors")
    mapped = load_file(tmp_path / "w.safetensors")["w"]
    before = rss_file_mb()
    assert mapped.sum().item() == weights.sum().item()  # reads every page
    assert rss_file_mb() - before > 48
    touched = rss_file_mb()
    page_out([mapped])
    assert touched - rss_file_mb() > 48
    assert torch.equal(mapped, weights)


def test_tensors_sharing_one_mapping_are_paged_out_each_alone(tmp_path):
    """Weights moved to one file (before lowering): paging out a serialized partition's tensor
    gives back its own pages only."""
    done, pending = torch.randn(64, 2**18), torch.randn(64, 2**18)  # 64 MB each
    want = pending.clone()
    move_to_file([done, pending], tmp_path / "weights")
    before = rss_file_mb()
    assert done.sum().item() != pending.sum().item()  # reads every page of both
    assert rss_file_mb() - before > 100
    touched = rss_file_mb()
    page_out([done])
    assert 48 < touched - rss_file_mb() < 80
    assert torch.equal(pending, want)


def test_only_file_mappings_are_paged_out(tmp_path, monkeypatch):
    """Anonymous memory (quantized weights, a bf16 checkpoint made fp32) would go to swap, not away."""
    from safetensors.torch import load_file, save_file

    calls = []
    monkeypatch.setattr(heap, "_madvise", lambda addr, size, advice: calls.append((addr.value, size.value)))
    save_file({"w": torch.randn(16, 2**16)}, tmp_path / "w.safetensors")
    mapped, anonymous = load_file(tmp_path / "w.safetensors")["w"], torch.randn(16, 2**16)
    page_out([anonymous])
    assert calls == []
    page_out([mapped])
    assert len(calls) == 1 and mapped.data_ptr() <= calls[0][0] and calls[0][1] >= 4 * 2**20 - 2 * 4096
