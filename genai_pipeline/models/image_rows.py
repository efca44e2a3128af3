"""The columns a vision-language program's embeddings carry after the embedding itself, so that its
text decoder knows an image's rows. ExecuTorch's MultimodalRunner calls `text_decoder(embeddings,
start_pos)` and nothing else, and feeds each image in a call of its own: what the decoder must know
of an image travels with its rows, written by `token_embedding` and `vision_encoder`, taken off by
`text_decoder`.

- "flag" (Gemma 3, whose image tokens see each other both ways): one column, 1 on an image's rows,
  0 on text's; the decoder builds its masks from it (decoder.image_block_masks).
- "mrope" (Qwen2.5-VL): three columns, (advance, row, col). A row's M-RoPE temporal position is the
  previous row's plus the previous row's advance; its height and width positions add row and col.
  Text rows are (1, 0, 0); an image's g_h x g_w tokens (0, r, c), its last token advancing by
  max(g_h, g_w): transformers' `get_rope_index`, where the text after an image continues one past
  the image's largest position. Any grid, any number of images, in any calls.
- "none": no columns (the other families).
"""

from __future__ import annotations

import torch
from torch import nn

COLUMNS = {"none": 0, "flag": 1, "mrope": 3}


def text_columns(h: torch.Tensor, kind: str) -> torch.Tensor:
    """Embeddings [1, T, D] of text -> [1, T, D + COLUMNS[kind]]."""
    if kind == "none":
        return h
    if kind == "flag":
        return torch.cat([h, torch.zeros_like(h[..., :1])], dim=-1)
    ones = torch.ones_like(h[..., :1])
    return torch.cat([h, ones, ones * 0, ones * 0], dim=-1)


def image_columns(h: torch.Tensor, kind: str, grid_cols: int) -> torch.Tensor:
    """Embeddings [1, N, D] of one image, its tokens row-major over a grid `grid_cols` wide ->
    [1, N, D + COLUMNS[kind]]."""
    if kind == "none":
        return h
    if kind == "flag":
        return torch.cat([h, torch.ones_like(h[..., :1])], dim=-1)
    k = torch.arange(h.shape[1])
    row, col = k // grid_cols, k % grid_cols
    side = torch.maximum(row.max(), col.max()) + 1  # max(g_h, g_w)
    advance = (k == h.shape[1] - 1) * side
    columns = torch.stack([advance, row, col], dim=-1).to(h.dtype)
    return torch.cat([h, columns.unsqueeze(0)], dim=-1)


def split_columns(h: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[1, T, D + c] -> (embeddings [1, T, D], columns [1, T, c] or None)."""
    n = COLUMNS[kind]
    return (h, None) if n == 0 else (h[..., :-n], h[..., -n:])


class MRopeCursor(nn.Module):
    """M-RoPE positions inside the program, from the "mrope" columns of what `text_decoder` is
    given. `next_position`, per cache row, is the temporal position of the row after it: a mutable
    buffer of text_decoder alone, written as the KV cache is, so a call at any position (a new
    conversation at 0, a rewind) reads that of the row before it. Tensor ops only: one trace serves
    every call."""

    def __init__(self, max_seq_len: int):
        super().__init__()
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (llama.update_cache)

        self.register_buffer("next_position", torch.zeros(1, max_seq_len, 1, 1), persistent=False)

    def forward(self, input_pos: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """The [3, T] positions of a call at cache position input_pos[0] with columns [1, T, 3]."""
        seq_len = columns.size(1)
        start = input_pos[0].item()
        torch._check(start >= 0)
        torch._check(start + seq_len <= self.next_position.size(1))
        before = torch.clamp(input_pos - 1, min=0)
        first = (torch.index_select(self.next_position.view(-1), 0, before) * (input_pos > 0)).to(torch.long)  # [1]
        advance, row, col = columns[0].round().to(torch.long).unbind(-1)
        t = first + torch.cumsum(advance, 0) - advance
        torch.ops.llama.update_cache((t + advance).to(torch.float32).view(1, -1, 1, 1), self.next_position, start)
        return torch.stack([t, t + row, t + col])

    def reset_buffers(self) -> None:
        self.next_position = torch.zeros(self.next_position.shape)
