"""The block kinds Qwen2.5-VL's ViT adds to the one vision encoder (models/vision.py): a patch conv
over still frames, 2D RoPE and window attention over a grid of any size, a gated MLP, the 2 x 2
patch merger.

The grid is the image's: a program's `vision_encoder` takes any multiple of 28 px per side up to
its bound (dynamic shapes), so the token order, RoPE tables and window mask are built in the
graph from the input's size, with tensor ops only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from genai_pipeline.models.decoder import RMSNorm


class TemporalPatchConv(nn.Module):
    """Qwen2.5-VL's Conv3d patch embedding (kernel = stride = [frames, p, p], no bias) on a still
    image, whose frames are all the same: the sum of the frames' kernels as one Conv2d."""

    def __init__(self, dim: int, patch_size: int, frames: int):
        super().__init__()
        self.patch_size = patch_size
        self.weight = nn.Parameter(torch.zeros(dim, 3, frames, patch_size, patch_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight.sum(2), stride=self.patch_size)


def block_order(rows: int, cols: int, scale: int) -> torch.Tensor:
    """[rows*cols]: the row-major patch index of each token when tokens run `scale` x `scale` block
    by block (blocks row-major, row-major within a block), as Qwen2VLImageProcessor orders patches."""
    index = torch.arange(rows * cols).view(rows // scale, scale, cols // scale, scale)
    return index.permute(0, 2, 1, 3).reshape(-1)


def rope_2d_tables(rows: int, cols: int, scale: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [1, tokens, 1, head_dim] of Qwen2.5-VL's 2D RoPE, tokens in merge-block order:
    a quarter of the head's frequencies turn with the patch's row, the next quarter with its
    column, the second half repeats the first (rotate-half form); float32, as transformers."""
    order = block_order(rows, cols, scale)
    row, col = (order // cols).float(), (order % cols).float()
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    angles = torch.cat([row[:, None] * inv_freq, col[:, None] * inv_freq], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)[None, :, None]
    return angles.cos(), angles.sin()


def window_mask(rows: int, cols: int, scale: int, side: int) -> torch.Tensor:
    """Additive [tokens, tokens]: 0 between tokens of the same window, -inf otherwise. Windows are
    `side` x `side` merged tokens from the top-left (the last ones cut by the image's edge), as
    transformers' `get_vision_window_index` groups them; attention is the same whichever order the
    tokens of a window run in, so the tokens stay in merge-block order."""
    merged_cols = cols // scale
    unit = torch.arange((rows // scale) * merged_cols).repeat_interleave(scale * scale)  # each token's merged token
    window = (unit // merged_cols) // side * merged_cols + (unit % merged_cols) // side
    same = window[:, None] == window[None, :]
    return torch.zeros(same.shape).masked_fill(~same, float("-inf"))


class GatedMLP(nn.Module):
    """Qwen2.5-VL's vision MLP: down(act(gate x) * up x), every linear with a bias."""

    def __init__(self, dim: int, hidden_dim: int, act):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim)
        self.up_proj = nn.Linear(dim, hidden_dim)
        self.down_proj = nn.Linear(hidden_dim, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PatchMerger(nn.Module):
    """Qwen2.5-VL's connector: RMSNorm per patch, then each block of scale² patches (consecutive
    tokens) concatenated through linear, GeLU, linear."""

    def __init__(self, dim: int, scale: int, text_dim: int, eps: float):
        super().__init__()
        self.width = dim * scale**2
        self.ln_q = RMSNorm(dim, eps)
        self.linear_1 = nn.Linear(self.width, self.width)
        self.linear_2 = nn.Linear(self.width, text_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_q(x).reshape(x.shape[0], -1, self.width)
        return self.linear_2(F.gelu(self.linear_1(h)))
