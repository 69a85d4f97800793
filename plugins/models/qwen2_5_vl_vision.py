"""Qwen2.5-VL's vision encoder: patch embedding, 2-D rotary, window and full attention blocks, the patch merger.

Patches arrive flattened (``[patches, channels * temporal_patch * patch * patch]``, each ``merge x merge`` block
of neighbours consecutive, as the model's image processor lays them out). Most blocks attend within windows of
``window_size`` pixels (whole merge blocks); the blocks in ``fullatt_block_indexes`` attend over each whole frame.
The merger joins each merge block into one token of the language model's width. Nothing here is sharded: every
tensor-parallel rank runs the whole encoder.

One forward lays its rows out once, on the host (:class:`EncoderLayout`): windows grouped by length, so the windows of
one length are consecutive rows and a window-attention block is one ``scaled_dot_product_attention`` call per
length (a frame's windows come in at most four lengths: whole, cut by the right edge, the bottom edge, both). Its
index tensors reach the device in one copy; the blocks then run without a host sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from treadle.core.execution.overlap import to_device
from treadle.kernels.fused_ops import rotary_qk_float32, silu_mul
from treadle.layers.linear import CheckpointError
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
        layout = EncoderLayout.build(grids, self.merge, self.window_size // self.merge // self.patch_size, device)
        unit = self.merge * self.merge
        hidden = self.patch_embed(pixel_values)
        n = hidden.shape[0]
        hidden = hidden.view(n // unit, unit, -1).index_select(0, layout.order).reshape(n, -1)
        cos, sin = self._cos_sin(layout.positions)
        residual = None
        for index, block in enumerate(self.blocks):
            segments = layout.frames if index in self.full_attention_blocks else layout.windows
            hidden, residual = block(hidden, residual, segments, cos, sin)
        merged = self.merger(hidden + residual)
        return merged.index_select(0, layout.restore)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[patches, head_dim]`` (float32) of each patch's (row, column) position: its row's
        frequencies, then its column's, twice (HF's ``rotate_half`` layout)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        half = (positions[:, :, None] * self.inv_freq).flatten(1)
        angles = torch.cat([half, half], dim=1)
        return angles.cos(), angles.sin()


@dataclass
class Segments:
    """Attention segments over the encoder's rows: ``groups`` of ``(first row, count, length)``, ``count``
    consecutive segments of ``length`` rows each, once the rows are taken in ``gather`` order (None: as they are;
    ``scatter`` puts them back)."""

    groups: list[tuple[int, int, int]]
    gather: torch.Tensor | None = None
    scatter: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
        """Bidirectional attention of ``[rows, heads * head_dim]`` q, k, v within each segment."""
        if self.gather is not None:
            q, k, v = (t.index_select(0, self.gather) for t in (q, k, v))
        outs = []
        for first, count, length in self.groups:
            rows = slice(first, first + count * length)
            shaped = [t[rows].view(count, length, heads, -1).transpose(1, 2) for t in (q, k, v)]
            outs.append(F.scaled_dot_product_attention(*shaped).transpose(1, 2).reshape(count * length, -1))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if self.scatter is None else out.index_select(0, self.scatter)


@dataclass
class EncoderLayout:
    """How one forward's patches are ordered: ``order`` (merge blocks in window order: windows longest first, each
    window's blocks row-major), ``restore`` (its inverse), each patch's ``positions`` ``[patches, 2]`` (row,
    column) in that order, and the ``windows`` and ``frames`` the attention blocks attend within."""

    order: torch.Tensor
    restore: torch.Tensor
    positions: torch.Tensor
    windows: Segments
    frames: Segments

    @classmethod
    def build(cls, grids: Sequence[Grid], merge: int, window_blocks: int, device: torch.device) -> "EncoderLayout":
        unit = merge * merge
        window, frame, rows, cols, base, frame_base = [], [], [], [], 0, 0
        for t, h, w in grids:
            bh, bw = h // merge, w // merge
            across = -(-bw // window_blocks)
            cell = (torch.arange(bh) // window_blocks)[:, None] * across + torch.arange(bw) // window_blocks
            windows = -(-bh // window_blocks) * across
            window.append((cell.flatten() + base + windows * torch.arange(t)[:, None]).flatten())
            frame.append(torch.arange(t).repeat_interleave(bh * bw) + frame_base)
            # each block's patches (row-major within the block) in rows and columns of patches
            r = torch.arange(h).view(bh, merge, 1, 1).expand(bh, merge, bw, merge).transpose(1, 2)
            c = torch.arange(w).view(1, 1, bw, merge).expand(bh, merge, bw, merge).transpose(1, 2)
            rows.append(r.reshape(bh * bw, unit).repeat(t, 1))
            cols.append(c.reshape(bh * bw, unit).repeat(t, 1))
            base += t * windows
            frame_base += t
        window_of, frame_of = torch.cat(window), torch.cat(frame)
        window_len = torch.bincount(window_of)[window_of]
        # longest windows first, then by window; stable, so each window's blocks stay row-major
        order = torch.sort(window_of - window_len * (base + 1), stable=True).indices
        windows = _segments(window_of[order], unit)
        frames = _segments(frame_of[order], unit)
        positions = torch.stack([torch.cat(rows)[order], torch.cat(cols)[order]], dim=-1).reshape(-1, 2)
        packed = [order, torch.argsort(order), positions.flatten()]
        for segments in (windows, frames):
            packed += [t for t in (segments.gather, segments.scatter) if t is not None]
        moved = iter(to_device(torch.cat(packed), device).split([len(t) for t in packed]))
        order, restore, positions = next(moved), next(moved), next(moved).view(-1, 2)
        for segments in (windows, frames):
            if segments.gather is not None:
                segments.gather, segments.scatter = next(moved), next(moved)
        return cls(order, restore, positions, windows, frames)


def _segments(owner: torch.Tensor, unit: int) -> Segments:
    """The segments of patches whose merge blocks (in row order) belong to one ``owner`` (a window or a frame):
    grouped by length, longest first, gathered into that order where it is not the rows' own (host tensors)."""
    owners, counts = torch.unique_consecutive(owner, return_counts=True)
    if len(torch.unique(owners)) != len(owners):  # an owner's blocks are not consecutive: gather them
        by_owner = torch.sort(owner, stable=True).indices
        return _gathered(_segments(owner[by_owner], unit), by_owner, unit)
    key = -counts * (len(counts) + 1) + torch.arange(len(counts))
    if not bool((key[1:] >= key[:-1]).all()):  # segments longest first: already so for windows
        starts = torch.cumsum(counts, 0) - counts
        by_length = torch.argsort(key)
        blocks = torch.cat([torch.arange(s, s + c) for s, c in zip(starts[by_length].tolist(),
                                                                     counts[by_length].tolist())])
        return _gathered(_segments(owner[blocks], unit), blocks, unit)
    groups: list[tuple[int, int, int]] = []
    first = 0
    lengths, repeats = torch.unique_consecutive(counts, return_counts=True)
    for length, repeat in zip(lengths.tolist(), repeats.tolist()):
        groups.append((first, repeat, length * unit))
        first += repeat * length * unit
    return Segments(groups)


def _gathered(inner: Segments, blocks: torch.Tensor, unit: int) -> Segments:
    """``inner``'s segments over rows taken from merge blocks ``blocks`` (composed with any gather it has)."""
    rows = (blocks[:, None] * unit + torch.arange(unit)).flatten()
    if inner.gather is not None:
        rows = rows[inner.gather]
    return Segments(inner.groups, rows, torch.argsort(rows))


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
    """Pre-norm attention and MLP; the residual adds run fused into the next norm (``(out, residual)`` in and
    out, as the language model's decoder layers)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        dim = int(config.hidden_size)
        self.norm1 = RMSNorm(dim, 1e-6)
        self.norm2 = RMSNorm(dim, 1e-6)
        self.attn = VisionAttention(dim, int(config.num_heads))
        self.mlp = VisionMLP(dim, int(config.intermediate_size))

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, segments: Segments, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            normed, residual = self.norm1(hidden), hidden
        else:
            normed, residual = self.norm1(hidden, residual)
        normed, residual = self.norm2(self.attn(normed, segments, cos, sin), residual)
        return self.mlp(normed), residual


class VisionAttention(nn.Module):
    """Bidirectional attention within each segment, the rotary embedding applied in float32."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, hidden: torch.Tensor, segments: Segments, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(hidden)
        dim = qkv.shape[1] // 3
        q, k = rotary_qk_float32(qkv, cos, sin, self.num_heads)
        return self.proj(segments.attend(q, k, qkv[:, 2 * dim:], self.num_heads))


class VisionMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, gate and up in one matrix product."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up_proj = StackedLinear(dim, hidden, ("gate_proj", "up_proj"))
        self.down_proj = nn.Linear(hidden, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x)))


class StackedLinear(nn.Linear):
    """An unsharded ``nn.Linear`` whose outputs are the checkpoint's ``shard_ids`` projections (each
    ``out_each`` wide, with bias) stacked in order, loaded one projection at a time."""

    def __init__(self, in_features: int, out_each: int, shard_ids: tuple[str, ...]) -> None:
        super().__init__(in_features, out_each * len(shard_ids), bias=True)
        self.shard_ids = shard_ids
        for param in (self.weight, self.bias):
            param.weight_loader = self._load_shard
            param.dummy_fills_rank = True  # unsharded: a dummy fill draws it whole on every rank

    def _load_shard(self, param: nn.Parameter, loaded: Any, shard_id: str | None = None) -> None:
        """Copy one projection (``shard_id``) or, with None, the whole stacked tensor."""
        rows = param.shape[0] // len(self.shard_ids)
        part = param.data if shard_id is None else param.data.narrow(0, self.shard_ids.index(shard_id) * rows, rows)
        tensor = loaded if isinstance(loaded, torch.Tensor) else loaded[...]
        if tuple(tensor.shape) != tuple(part.shape):
            raise CheckpointError(f"has shape {tuple(tensor.shape)} but the model expects {tuple(part.shape)}")
        part.copy_(tensor)


class PatchMerger(nn.Module):
    """Each ``merge x merge`` block of patches (consecutive rows) -> one embedding of the language model's width."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = RMSNorm(dim, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))
