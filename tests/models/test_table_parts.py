"""models/table_parts.py: a tied table split into its first rows and the rest computes what the whole
table did, for lookup and LM head, and each head part reads its lookup part's storage."""

import pytest
import torch

from genai_pipeline.models.decoder import Decoder
from genai_pipeline.models.table_parts import TableHead, TableLookup, split_table
from genai_pipeline.registry import get_spec


def reference_decoder() -> Decoder:
    torch.manual_seed(0)
    decoder = Decoder(get_spec("reference").config, max_seq_len=32).eval()  # tied, 4096 rows
    for p in decoder.parameters():
        p.data.normal_(0, 0.2)
    decoder.tie_weights()
    return decoder


@pytest.mark.parametrize("rows", [1, 1000, 4095])
def test_a_split_table_gives_the_whole_tables_logits(rows):
    decoder = reference_decoder()
    ids = torch.tensor([[0, rows - 1, rows, 4095, 17, rows + 1 if rows < 4095 else 3]])
    with torch.no_grad():
        want = decoder(ids, torch.tensor([0]))
        decoder.reset_buffers()
        split_table(decoder, rows)
        got = decoder(ids, torch.tensor([0]))
    assert isinstance(decoder.tok_embeddings, TableLookup) and isinstance(decoder.output, TableHead)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the same products, blocked otherwise by the matmul
    for part in ("first", "rest"):
        lookup, head = getattr(decoder.tok_embeddings, part), getattr(decoder.output, part)
        assert lookup.weight.data_ptr() == head.weight.data_ptr()  # tied: one table in memory


@pytest.mark.parametrize("rows", [0, 4096])
def test_a_split_leaves_both_parts_some_rows(rows):
    with pytest.raises(ValueError, match="splits after 1 to 4095 rows"):
        split_table(reference_decoder(), rows)
