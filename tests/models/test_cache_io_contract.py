"""The cache-I/O form's contract (models/cache_io.py): the inputs of one call. The form driven
against the ordinary decoder: tests/runtime/test_cache_io.py."""

from __future__ import annotations

import torch

from genai_pipeline.models.cache_io import CacheIOContract
from genai_pipeline.models.decoder import MASK_HIDDEN


def test_call_inputs_follow_the_contract():
    contract = CacheIOContract(
        n_layers=1, n_kv_heads=1, head_dim=2, max_seq_len=6, tokens_per_call={"prefill_chunk": 4, "decode_token": 1}
    )
    cache = [torch.zeros(1, 1, 6, 2)]
    tokens, positions, mask, *_ = contract.call_inputs([7, 8], pos=3, rows=4, k_cache=cache, v_cache=cache)
    assert tokens.tolist() == [[0, 0, 7, 8]] and positions.tolist() == [[3, 3, 3, 4]]  # left-padded
    seen = (mask[0, 0] == 0).int().tolist()  # columns: cache rows 0..5, then this call's rows 0..3
    assert seen == [
        [0, 0, 0, 0, 0, 0, 1, 0, 0, 0],  # padding rows see only themselves
        [0, 0, 0, 0, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 1, 0],  # real rows: cache rows before the cursor, real rows up to themselves
        [1, 1, 1, 0, 0, 0, 0, 0, 1, 1],
    ]
    assert set(mask.unique().tolist()) == {0.0, MASK_HIDDEN}
