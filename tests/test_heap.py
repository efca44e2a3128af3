"""heap.move_to_file: tensors' bytes moved to a memory-mapped file, values and views unchanged."""

import torch

from genai_pipeline.heap import move_to_file


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


def test_nothing_to_move_leaves_no_file(tmp_path):
    assert move_to_file([torch.randn(0)], tmp_path / "weights") == 0
    assert not (tmp_path / "weights").exists()
