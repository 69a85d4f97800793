"""What one panel-packed integer weight shape runs per batch size (:class:`IntKernelPlan`), from the launch configs
of ``kernels/packed_int.py`` (the one-token GEMV, ``int_dot``), ``kernels/packed_int_mma.py`` (``int_mma``),
``kernels/packed_int_magic.py`` (``magic_mma``), ``kernels/packed_int_natural.py`` (``natural_mma``) and
``kernels/packed_int_wide.py`` (``wide_mma``): one row runs the GEMV, 2 to the plan's ``dot_max_rows`` (at most
``DOT_MAX_ROWS``) rows a ``tl.dot`` kernel (per row bucket the fastest of ``magic_mma``, ``natural_mma``,
``int_mma`` and ``int_dot``, timed at load by ``layers/int_kernel_choice.py``); with 16-bit activations, 65 up to
the last of its row buckets (128, 256, 512, 1024) that beat the dequantization, ``wide_mma``; larger batches
:func:`dequantize_linear` (``kernels/packed_int_dequant.py``'s dequantization into one buffer per device, then
the library matmul).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import torch
import torch.nn.functional as F

from treadle.kernels.fused_ops import silu_mul
from treadle.kernels.packed_int import (DOT_MAX_ROWS, IntTiles, gemv_candidates, int_dot, int_gemv, tile_candidates,
                                        tiles_shape)
from treadle.kernels.packed_int_dequant import DequantBuffer, DequantTiles, dequantize, load_dequantize_candidates
from treadle.kernels.packed_int_magic import MagicMmaTiles, magic_mma
from treadle.kernels.packed_int_mma import MmaTiles, int_mma, load_candidates
from treadle.kernels.packed_int_natural import NaturalMmaTiles, natural_candidates, natural_mma
from treadle.kernels.packed_int_wide import WIDE_BUCKETS, WideMmaTiles, wide_candidates, wide_mma


@dataclass(frozen=True)
class SiluMulTiles:
    """A ``[gate | up]`` weight's ``silu(gate) * up`` by ``tiles`` (a ``natural_mma`` launch without split-K):
    ``fused``, in its epilogue (``natural_mma``'s ``silu_mul``), else the matmul, then ``kernels/fused.py``'s
    ``silu_mul``: what the loader races per row bucket (:func:`plan_kernels`)."""

    tiles: NaturalMmaTiles
    fused: bool


# One launch of the GEMV or ``int_dot`` (IntTiles), of ``int_mma`` (MmaTiles), of ``magic_mma`` (MagicMmaTiles:
# what 2 to 64 rows run first where it applies), of ``natural_mma`` (NaturalMmaTiles), of ``wide_mma`` (WideMmaTiles:
# 65 to 1024 rows), or the dequantization and the library matmul (DequantTiles); or a gated MLP's product
# (SiluMulTiles).
Tiles = Union[IntTiles, MmaTiles, MagicMmaTiles, NaturalMmaTiles, WideMmaTiles, DequantTiles, SiluMulTiles]


@dataclass(frozen=True)
class IntKernelPlan:
    """What one weight shape runs per batch size, chosen once at load (:func:`plan_kernels`): ``gemv`` for one
    row, ``small`` for up to 16 rows, ``medium`` up to 32, ``large`` up to ``dot_max_rows`` (64, 128 or
    ``DOT_MAX_ROWS``), then :func:`dequantize_linear` with ``dequant``'s launch (so do act-order weights whose sorted
    groups are uneven); ``wide``: ``(most rows, launch)`` per row bucket above 64 (ascending, ``wide_mma``'s),
    each run from 65 rows (or the bucket before's most) up to its most, before ``dot_max_rows`` (64 where there are
    any) and the dequantization apply; the loader times ``dot_max_rows``, ``wide`` and ``dequant`` like the
    launches. ``fused_silu_mul``: per bucket (small, medium, large), whether a ``[gate | up]`` weight's
    ``silu(gate) * up`` runs in the matmul's kernel (:class:`SiluMulTiles`, timed at load)."""

    bits: int
    group: int
    gemv: IntTiles
    small: Tiles
    medium: Tiles
    large: Tiles
    dot_max_rows: int = DOT_MAX_ROWS
    dequant: DequantTiles = DequantTiles()
    wide: tuple[tuple[int, WideMmaTiles], ...] = ()
    fused_silu_mul: tuple[bool, bool, bool] = (False, False, False)

    def run_silu_mul(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                     prefetch: torch.Tensor | None = None) -> torch.Tensor | None:
        """``silu(gate) * up`` of a ``[gate | up]`` weight in one kernel: one token where the one-token GEMV needs
        no split-K, 2 to ``dot_max_rows`` where the row bucket's ``fused_silu_mul`` says so; None: the caller runs
        the matmul, then ``silu_mul``. ``prefetch``: as :meth:`run`'s."""
        rows = x.shape[0]
        if rows == 1:
            if self.gemv.split_k != 1:
                return None
            return int_gemv(x, weight, scales, zeros, self.bits, self.group, self.gemv, silu_mul=True,
                            prefetch=prefetch)
        bucket = 0 if rows <= 16 else 1 if rows <= 32 else 2
        if rows > self.dot_max_rows or not self.fused_silu_mul[bucket]:
            return None
        tiles = (self.small, self.medium, self.large)[bucket]
        return natural_mma(x, weight, scales, zeros, self.bits, self.group, tiles, prefetch, silu_mul=True)

    def run_add_rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        prefetch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rmsnorm(y + residual) * norm_weight, y + residual)`` for one token's ``y`` in the GEMV (its program
        that stores the row's last tile adds and norms); None for a batch of more (the caller runs the matmul,
        then the norm)."""
        if x.shape[0] != 1:
            return None
        return int_gemv(x, weight, scales, zeros, self.bits, self.group, self.gemv,
                        add_rmsnorm=(residual, norm_weight, eps), prefetch=prefetch)

    def run(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            g_idx: torch.Tensor | None, prefetch: torch.Tensor | None = None,
            buffer: DequantBuffer | None = None) -> torch.Tensor:
        """``x @ dequantized(weight).T`` by the kernel this many rows run; ``prefetch`` (the head of the weight the
        model reads next, ``layer.l2_prefetch``) is asked of L2 by the last programs of the GEMV, ``magic_mma``
        and ``natural_mma``; ``buffer`` (``layer.dequant_buffer``) takes the dequantized weight of large batches
        (None: a new tensor)."""
        rows = x.shape[0]
        if g_idx is None and self.wide and 64 < rows <= self.wide[-1][0]:
            tiles = next(launch for most, launch in self.wide if rows <= most)
            return run_tiles(x, weight, scales, zeros, self.bits, self.group, tiles)
        if g_idx is None and rows <= self.dot_max_rows:
            tiles = self.gemv if rows == 1 else self.small if rows <= 16 else self.medium if rows <= 32 else self.large
            return run_tiles(x, weight, scales, zeros, self.bits, self.group, tiles, prefetch)
        return dequantize_linear(x, weight, scales, zeros, g_idx, self.bits, self.group, self.dequant, buffer)


def dequantize_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      g_idx: torch.Tensor | None, bits: int, group: int, tiles: DequantTiles = DequantTiles(),
                      buffer: DequantBuffer | None = None) -> torch.Tensor:
    """``x @ dequantized(weight).T`` for large batches: the weight dequantized (into ``buffer``, the device's one,
    where given), then the library matmul."""
    n, k = weight.shape[0], weight.shape[1] * (32 // bits)
    out = buffer.view(n, k, x.dtype) if buffer is not None else None
    return F.linear(x, dequantize(weight, scales, zeros, g_idx, bits, group, x.dtype, out, tiles))


def run_tiles(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
              group: int, tiles: Tiles, prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantized(weight).T`` by the kernel ``tiles`` configures (``prefetch``: see :meth:`IntKernelPlan.run`;
    the GEMV, ``magic_mma`` and ``natural_mma`` take it, the others do not)."""
    if isinstance(tiles, DequantTiles):  # into a new tensor: the loader times this before the KV pool is sized
        return dequantize_linear(x, weight, scales, zeros, None, bits, group, tiles)
    if isinstance(tiles, SiluMulTiles):
        if tiles.fused:
            return natural_mma(x, weight, scales, zeros, bits, group, tiles.tiles, prefetch, silu_mul=True)
        return silu_mul(natural_mma(x, weight, scales, zeros, bits, group, tiles.tiles, prefetch))
    if isinstance(tiles, MmaTiles):
        return int_mma(x, weight, scales, zeros, bits, group, tiles)
    if isinstance(tiles, MagicMmaTiles):
        return magic_mma(x, weight, scales, zeros, bits, group, tiles, prefetch)
    if isinstance(tiles, NaturalMmaTiles):
        return natural_mma(x, weight, scales, zeros, bits, group, tiles, prefetch)
    if isinstance(tiles, WideMmaTiles):
        return wide_mma(x, weight, scales, zeros, bits, group, tiles)
    if tiles.block_m == 0:
        return int_gemv(x, weight, scales, zeros, bits, group, tiles, prefetch=prefetch)
    return int_dot(x, weight, scales, zeros, bits, group, tiles)


def plan_kernels(n: int, k: int, bits: int, group: int, sm_count: int,
                 pick: Callable[[list, int], Tiles] | None = None,
                 dtype: torch.dtype | None = None) -> IntKernelPlan | None:
    """The kernels for a panel-packed weight of ``n`` x ``k`` (None: a shape they do not tile, left to the torch
    path) multiplying activations of ``dtype`` (None: any; ``magic_mma`` needs 16-bit ones). ``pick(candidates,
    rows)`` chooses among launch configs for a batch of ``rows`` (the loader times them on the GPU); without it,
    the first candidate (and no ``wide_mma`` buckets: the kernels of 64 rows up to ``DOT_MAX_ROWS``)."""
    if not tiles_shape(k, bits, group):
        return None
    choose = pick or (lambda candidates, rows: candidates[0])
    gemv = choose(gemv_candidates(n, k, bits, sm_count), 1)
    small, medium, large = (choose(batch_candidates(n, k, bits, group, rows, sm_count, dtype), rows)
                            for rows in (16, 32, 64))
    dequant = choose(load_dequantize_candidates(), 512)
    wide = (_wide_buckets(n, k, bits, group, sm_count, dequant, pick)
            if pick is not None and dtype in (torch.float16, torch.bfloat16) else ())
    most = 64 if wide else _dot_max_rows(large, dequant, choose)
    fused = tuple(_fuses_silu_mul(tiles, n, rows, choose) for tiles, rows in ((small, 16), (medium, 32), (large, 64)))
    return IntKernelPlan(bits, group, gemv, small, medium, large, most, dequant, wide, fused)


def _fuses_silu_mul(tiles: Tiles, n: int, rows: int, choose: Callable[[list, int], Tiles]) -> bool:
    """Whether a ``[gate | up]`` weight's ``silu(gate) * up`` runs in ``tiles``' kernel at ``rows``: a
    ``natural_mma`` launch without split-K where the fused form beat the matmul and the separate ``silu_mul``
    (untimed: not fused)."""
    if not isinstance(tiles, NaturalMmaTiles) or tiles.split_k != 1 or n % 2:
        return False
    return choose([SiluMulTiles(tiles, False), SiluMulTiles(tiles, True)], rows).fused


def _wide_buckets(n: int, k: int, bits: int, group: int, sm_count: int, dequant: DequantTiles,
                  choose: Callable[[list, int], Tiles]) -> tuple[tuple[int, WideMmaTiles], ...]:
    """``IntKernelPlan.wide``: per row bucket (128, 256, 512, 1024) the fastest ``wide_mma`` launch, raced against
    the dequantization (``dequant``) and the library matmul at that many rows, up to the first bucket it loses
    (the dequantization writes the 16-bit weight once whatever the rows; ``wide_mma`` widens it again for every
    128 of them, so beyond some batch the library matmul wins)."""
    wide = []
    for rows in WIDE_BUCKETS:
        candidates = wide_candidates(n, k, bits, group, rows, sm_count)
        if not candidates:
            break
        best = choose([*candidates, dequant], rows)
        if not isinstance(best, WideMmaTiles):
            break
        wide.append((rows, best))
    return tuple(wide)


def _dot_max_rows(large: Tiles, dequant: DequantTiles, choose: Callable[[list, int], Tiles]) -> int:
    """The most rows the ``tl.dot`` kernels run: ``DOT_MAX_ROWS`` untimed; timed, the last of 64, 128 and 256
    rows up to which ``large`` beat the dequantization (``dequant``) and the library matmul (the ``tl.dot`` tiles
    widen the weight again for every 64 rows, the library matmul reads it widened once)."""
    most = 64
    for rows in (128, 256):
        if rows > DOT_MAX_ROWS or choose([large, dequant], rows) != large:
            break
        most = rows
    return most


def batch_candidates(n: int, k: int, bits: int, group: int, rows: int, sm_count: int,
                     dtype: torch.dtype | None = None) -> list[Tiles]:
    """The ``tl.dot`` launches timed for a batch of about ``rows`` (16, 32 or 64), the untimed choice first:
    ``magic_mma``'s where it applies (it won every shape at 16 and 32 rows in the round-1 sweep), then
    ``natural_mma``'s (same conditions), then ``int_mma``'s, then ``int_dot``'s, whose first config stays as the
    fallback for a K the ``tl.dot`` steps of the others do not tile."""
    dot = tile_candidates(n, k, bits, rows, sm_count)
    listed = load_candidates(n, k, bits, group, rows, sm_count, dtype)
    magic = [t for t in listed if isinstance(t, MagicMmaTiles)]
    natural = natural_candidates(n, k, bits, group, rows, sm_count) if magic else []
    return magic + natural + [t for t in listed if not isinstance(t, MagicMmaTiles)] + (dot if rows > 32 else dot[:1])
