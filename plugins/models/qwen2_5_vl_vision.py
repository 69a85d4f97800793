"""Qwen2.5-VL's vision encoder: patch embedding, 2-D rotary, window and full attention blocks, the patch merger.

Patches arrive flattened (``[patches, channels * temporal_patch * patch * patch]``, each ``merge x merge`` block
of neighbours consecutive, as the model's image processor lays them out). Most blocks attend within windows of
``window_size`` pixels (whole merge blocks, regrouped so each window is contiguous); the blocks in
``fullatt_block_indexes`` attend over each whole frame. The merger joins each merge block into one token of the
language model's width. Nothing here is sharded: every tensor-parallel rank runs the whole encoder.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from treadle.layers.norm import RMSNorm

Grid = tuple[int, int, int]


class VisionTransformer(nn.Module):
    """Pixels of images and videos in, one language-model embedding per merged patch out (in input order)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.merge = int(config.spatial_merge_size)
        self.patch_size = int(config.patch_size)
        self.window_size = int(config.window_size)
        self.full_attention_blocks = set(config.fullatt_block_indexes)
        dim, channels = int(config.hidden_size), int(config.in_channels)
        self.patch_embed = PatchEmbed(channels, int(config.temporal_patch_size), self.patch_size, dim)
        head_dim = dim // int(config.num_heads)
        rope = getattr(config, "rope_parameters", None) or {}
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
        self.inv_freq = 1.0 / (float(rope.get("rope_theta", 10000.0)) ** quarter)  # float32 whatever the dtype
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(int(config.depth)))
        self.merger = PatchMerger(int(config.out_hidden_size), dim, self.merge)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        device = pixel_values.device
        order, window_lens, frame_lens = self._layout(grids)
        unit = self.merge * self.merge
        hidden = self.patch_embed(pixel_values)
        n = hidden.shape[0]
        order_dev = order.to(device)
        hidden = hidden.view(n // unit, unit, -1)[order_dev].reshape(n, -1)
        angles = self._angles(grids).to(device).view(n // unit, unit, -1)[order_dev].reshape(n, -1)
        cos, sin = angles.cos(), angles.sin()
        for index, block in enumerate(self.blocks):
            lens = frame_lens if index in self.full_attention_blocks else window_lens
            hidden = block(hidden, lens, cos, sin)
        merged = self.merger(hidden)
        return merged[torch.argsort(order_dev)]

    def _angles(self, grids: Sequence[Grid]) -> torch.Tensor:
        """Each patch's rotary angles ``[patches, head_dim]``: its row's frequencies, then its column's."""
        rows, cols = [], []
        m = self.merge
        for t, h, w in grids:
            r = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
            c = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
            rows.append(r.repeat(t))
            cols.append(c.repeat(t))
        row, col = torch.cat(rows).to(self.inv_freq.device), torch.cat(cols).to(self.inv_freq.device)
        half = torch.cat([row[:, None] * self.inv_freq, col[:, None] * self.inv_freq], dim=1)
        return torch.cat([half, half], dim=1)

    def _layout(self, grids: Sequence[Grid]) -> tuple[torch.Tensor, list[int], list[int]]:
        """The merge-block order that makes each attention window contiguous, the windows' lengths and the
        frames' lengths (in patches)."""
        m, unit = self.merge, self.merge * self.merge
        blocks_per_window = self.window_size // m // self.patch_size
        order: list[torch.Tensor] = []
        window_lens: list[int] = []
        frame_lens: list[int] = []
        base = 0
        for t, h, w in grids:
            bh, bw = h // m, w // m
            index = torch.arange(t * bh * bw).view(t, bh, bw)
            for frame in range(t):
                frame_lens.append(h * w)
                for top in range(0, bh, blocks_per_window):
                    for left in range(0, bw, blocks_per_window):
                        window = index[frame, top:top + blocks_per_window, left:left + blocks_per_window].reshape(-1)
                        order.append(window + base)
                        window_lens.append(window.numel() * unit)
            base += t * bh * bw
        return torch.cat(order), window_lens, frame_lens


class PatchEmbed(nn.Module):
    """A convolution whose stride is its kernel: one matrix product per flattened patch."""

    def __init__(self, channels: int, temporal_patch: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(dim, channels, temporal_patch, patch, patch))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1))


class VisionBlock(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = int(config.hidden_size)
        self.norm1 = RMSNorm(dim, 1e-6)
        self.norm2 = RMSNorm(dim, 1e-6)
        self.attn = VisionAttention(dim, int(config.num_heads))
        self.mlp = VisionMLP(dim, int(config.intermediate_size))

    def forward(self, hidden: torch.Tensor, lens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.norm1(hidden), lens, cos, sin)
        return hidden + self.mlp(self.norm2(hidden))


class VisionAttention(nn.Module):
    """Bidirectional attention within each segment of ``lens`` consecutive patches, rotary applied in float32."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, hidden: torch.Tensor, lens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv(hidden).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return self.proj(segment_attention(q, k, v, lens).reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    wide = x.float()
    first, second = wide.chunk(2, dim=-1)
    turned = torch.cat([-second, first], dim=-1)
    return (wide * cos[:, None, :] + turned * sin[:, None, :]).to(x.dtype)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """Attention of ``[tokens, heads, dim]`` tensors within consecutive segments; segments of one length run as
    one batched call (an image's windows are mostly the same size)."""
    out = torch.empty_like(q)
    starts: dict[int, list[int]] = defaultdict(list)
    position = 0
    for length in lens:
        starts[length].append(position)
        position += length
    for length, firsts in starts.items():
        rows = (torch.tensor(firsts)[:, None] + torch.arange(length)).to(q.device)
        attended = F.scaled_dot_product_attention(q[rows].transpose(1, 2), k[rows].transpose(1, 2),
                                                  v[rows].transpose(1, 2))
        out[rows] = attended.transpose(1, 2)
    return out


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class PatchMerger(nn.Module):
    """Each ``merge x merge`` block of patches (consecutive rows) -> one embedding of the language model's width."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = RMSNorm(dim, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))
