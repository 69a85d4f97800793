"""Triton kernels for integer weights with group scales (W4A16, W8A16), in ``layers/packed_int.py``'s layout:
``weight`` int32 ``[N, K * bits / 32]`` (each row packed along K, lowest bits first), ``scales`` / ``zeros``
``[N, groups]``, optional ``g_idx`` ``[K]`` (act-order: each column's group).

- :func:`int_gemv` — one token (no act-order): each program streams ``BLOCK_N`` rows of packed words once, unpacks
  them in registers, multiplies by x in float32 and applies each group's scale (and zero) to the group's sums;
  split-K programs (K cut into ranges, for shapes with few output tiles) add float32 partials atomically.
- :func:`int_dot` — a few to a few hundred rows: each K step dequantizes a ``[BLOCK_K, BLOCK_N]`` tile of the
  weight to the activations' dtype in registers and multiplies on the tensor cores (``tl.dot``, float32 sums).
- :func:`dequantize` — larger batches: the whole weight to 16 bits once per call, then the library matmul.

:func:`choose_kernels` picks per weight shape, once at load, which kernel and tiles each batch size runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@dataclass(frozen=True)
class IntTiles:
    """One launch's tiles: ``block_m`` 0 means the GEMV; ``split_k`` K ranges reduced atomically. ``dup``: each value
    loads its own word (addresses repeat ``32 / bits`` times, served by L1) and shifts it, instead of loading each
    word once and splitting it in registers (a reshape whose cost depends on the layout Triton picks)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    dup: bool = False


# Batches up to this many rows run the tiles that dequantize in registers; larger ones dequantize the whole weight
# once and run the library matmul (compute-bound there: the 16-bit weight is read from L2-sized tiles either way).
DOT_MAX_ROWS = 256


@dataclass(frozen=True)
class IntKernelPlan:
    """What one weight shape runs per batch size, chosen once at load (:func:`plan_kernels`): ``gemv`` for one
    row (None: ``small``), ``small`` for up to 16 rows, ``medium`` up to ``DOT_MAX_ROWS``, then :func:`dequantize`
    and ``F.linear``."""

    bits: int
    group: int
    gemv: IntTiles | None
    small: IntTiles
    medium: IntTiles

    def run_silu_mul(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None
                     ) -> torch.Tensor | None:
        """``silu(gate) * up`` of a ``[gate | up]`` weight for one token in one kernel, where the one-token GEMV
        needs no split-K; None: the caller runs the matmul, then ``silu_mul``."""
        if x.shape[0] != 1 or self.gemv is None or self.gemv.split_k != 1:
            return None
        return int_gemv(x, weight, scales, zeros, self.bits, self.group, self.gemv, silu_mul=True)

    def run(self, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            g_idx: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        if rows == 1 and self.gemv is not None:
            return int_gemv(x, weight, scales, zeros, self.bits, self.group, self.gemv)
        if rows <= DOT_MAX_ROWS:
            tiles = self.small if rows <= 16 else self.medium
            return int_dot(x, weight, scales, zeros, g_idx, self.bits, self.group, tiles)
        return F.linear(x, dequantize(weight, scales, zeros, g_idx, self.bits, self.group, x.dtype))


def plan_kernels(n: int, k: int, bits: int, group: int, act_order: bool, sm_count: int,
                 pick: Callable[[list[IntTiles], int], IntTiles] | None = None) -> IntKernelPlan | None:
    """The kernels for a weight of ``n`` x ``k`` (None: a shape they do not tile, left to the torch path).
    ``pick(candidates, rows)`` chooses among launch configs for a batch of ``rows`` (the model loader times them on
    the GPU); without it, the first candidate, whose split-K fills ``2 * sm_count`` programs."""
    if k % 128 or not (group % 128 == 0 or 128 % group == 0):
        return None
    choose = pick or (lambda candidates, rows: candidates[0])
    gemv = None if act_order else choose(gemv_candidates(n, k, group, sm_count), 1)
    small = choose(tile_candidates(n, k, 16, sm_count), 16)
    medium = choose(tile_candidates(n, k, 64, sm_count), 64)
    return IntKernelPlan(bits, group, gemv, small, medium)


def gemv_candidates(n: int, k: int, group: int, sm_count: int) -> list[IntTiles]:
    """One-token GEMV configs for an ``n`` x ``k`` weight: rows per program, K per step (whole groups, or within one),
    both ways of unpacking, split-K filling the GPU and twice that."""
    candidates = []
    for block_n, block_k, warps in ((32, 256, 4), (16, 256, 4), (64, 128, 8), (32, 128, 4)):
        if k % block_k or not (group % block_k == 0 or block_k % group == 0):
            continue
        split = _split(n, k, block_n, block_k, sm_count)
        for dup in (False, True):
            for factor in (1, 2):
                tiles = IntTiles(0, block_n, block_k, split * factor, warps, dup)
                if k % (tiles.split_k * block_k) == 0 and tiles not in candidates:
                    candidates.append(tiles)
    return candidates


def tile_candidates(n: int, k: int, rows: int, sm_count: int) -> list[IntTiles]:
    """``tl.dot`` tile configs for batches of about ``rows`` tokens."""
    block_m = 16 if rows <= 16 else 64
    shapes = ((64, 128, 4), (128, 128, 8), (32, 128, 4)) if rows <= 16 else ((128, 64, 8), (64, 64, 4), (128, 128, 8))
    candidates = []
    for block_n, block_k, warps in shapes:
        if k % block_k:
            continue
        split = _split(n, k, block_n, block_k, sm_count) if rows <= 16 else 1
        for dup in (False, True):
            for factor in ((1, 2) if rows <= 16 else (1,)):
                tiles = IntTiles(block_m, block_n, block_k, split * factor, warps, dup)
                if k % (tiles.split_k * block_k) == 0 and tiles not in candidates:
                    candidates.append(tiles)
    return candidates


def _split(n: int, k: int, block_n: int, block_k: int, sm_count: int) -> int:
    tiles, split = triton.cdiv(n, block_n), 1
    while tiles * split < 2 * sm_count and split < 8 and k % (2 * split * block_k) == 0:
        split *= 2
    return split


def int_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
             group: int, tiles: IntTiles, silu_mul: bool = False) -> torch.Tensor:
    """``x [M, K] @ dequantized(weight).T`` one program row per token (meant for M = 1); no act-order. With
    ``silu_mul`` (no split-K) the weight is ``[gate | up]`` and the result ``silu(gate) * up``, in one kernel."""
    rows, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = _output(rows, n, x.dtype, x.device, tiles.split_k)
    groups_per_block = max(tiles.block_k // group, 1)
    grid = (triton.cdiv(n, tiles.block_n), tiles.split_k, rows)
    _int_gemv_kernel[grid](
        x, weight, scales, zeros if zeros is not None else scales, out, n, k // tiles.split_k,
        x.stride(0), weight.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, GROUP=group, NG=groups_per_block, GSZ=tiles.block_k // groups_per_block,
        HAS_ZEROS=zeros is not None, ATOMIC=tiles.split_k > 1, SILU_MUL=silu_mul, DUP=tiles.dup,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps)
    return out if tiles.split_k == 1 else out.to(x.dtype)


def int_dot(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
            g_idx: torch.Tensor | None, bits: int, group: int, tiles: IntTiles) -> torch.Tensor:
    """``x [M, K] @ dequantized(weight).T``, each weight tile dequantized in registers and multiplied by ``tl.dot``."""
    rows, k = x.shape
    n = weight.shape[0]
    out = _output(rows, n, x.dtype, x.device, tiles.split_k)
    grid = (triton.cdiv(rows, tiles.block_m), triton.cdiv(n, tiles.block_n), tiles.split_k)
    _int_dot_kernel[grid](
        x, weight, scales, zeros if zeros is not None else scales, g_idx if g_idx is not None else scales, out,
        rows, n, k // tiles.split_k, x.stride(0), weight.stride(0), scales.stride(0), out.stride(0),
        BITS=bits, GROUP=group, HAS_ZEROS=zeros is not None, HAS_GIDX=g_idx is not None,
        ATOMIC=tiles.split_k > 1, DUP=tiles.dup, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, num_warps=tiles.num_warps)
    return out if tiles.split_k == 1 else out.to(x.dtype)


def dequantize(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, g_idx: torch.Tensor | None,
               bits: int, group: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight ``[N, K]`` in ``dtype`` (into ``out`` when given)."""
    n, k = weight.shape[0], weight.shape[1] * (32 // bits)
    out = torch.empty(n, k, dtype=dtype, device=weight.device) if out is None else out
    block_n, block_k = 32, 128
    _dequantize_kernel[(triton.cdiv(n, block_n), k // block_k)](
        weight, scales, zeros if zeros is not None else scales, g_idx if g_idx is not None else scales, out, n,
        weight.stride(0), scales.stride(0), out.stride(0), BITS=bits, GROUP=group, HAS_ZEROS=zeros is not None,
        HAS_GIDX=g_idx is not None, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def _output(rows: int, n: int, dtype: torch.dtype, device: torch.device, split_k: int) -> torch.Tensor:
    if split_k == 1:
        return torch.empty(rows, n, dtype=dtype, device=device)
    return torch.zeros(rows, n, dtype=torch.float32, device=device)


@triton.jit
def _unpack(words, BITS: tl.constexpr, PACK: tl.constexpr):
    """[R, W] int32 words -> [R, W * PACK] unsigned values as float32, lowest bits first."""
    shifts = tl.arange(0, PACK) * BITS
    values = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(values, [words.shape[0], words.shape[1] * PACK]).to(tl.float32)


@triton.jit
def _gemv_rows(x_ptr, w_ptr, s_ptr, z_ptr, offs_n, n_mask, k_begin, k_per_split, stride_wn, stride_sn,
               BITS: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, GSZ: tl.constexpr, HAS_ZEROS: tl.constexpr,
               DUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 sums of one activation row (at ``x_ptr``) with the weight rows ``offs_n`` over one K range; the K
    step holds ``NG`` groups of ``GSZ`` columns (one group, or part of one, when ``NG`` is 1)."""
    PACK: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = 1 << (BITS - 1)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if DUP:
            words = tl.load(w_ptr + offs_n[:, None] * stride_wn + (offs_k // PACK)[None, :], mask=n_mask[:, None],
                            other=0, eviction_policy="evict_first")
            q = ((words >> ((offs_k % PACK) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        else:
            words = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 // PACK + tl.arange(0, BLOCK_K // PACK))[None, :],
                            mask=n_mask[:, None], other=0, eviction_policy="evict_first")
            q = _unpack(words, BITS, PACK)
        x = tl.load(x_ptr + offs_k).to(tl.float32)
        if NG == 1:
            s = tl.load(s_ptr + offs_n * stride_sn + k0 // GROUP, mask=n_mask, other=0).to(tl.float32)
            sums, x_sum = tl.sum(q * x[None, :], axis=1), tl.sum(x, axis=0)
            if HAS_ZEROS:
                z = tl.load(z_ptr + offs_n * stride_sn + k0 // GROUP, mask=n_mask, other=0).to(tl.float32)
                acc += s * (sums - z * x_sum)
            else:
                acc += s * (sums - HALF * x_sum)
        else:
            group_sums = tl.sum(tl.reshape(q * x[None, :], [BLOCK_N, NG, GSZ]), axis=2)
            x_sums = tl.sum(tl.reshape(x, [NG, GSZ]), axis=1)
            g = k0 // GROUP + tl.arange(0, NG)
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + g[None, :], mask=n_mask[:, None], other=0)
            if HAS_ZEROS:
                z = tl.load(z_ptr + offs_n[:, None] * stride_sn + g[None, :], mask=n_mask[:, None], other=0)
                acc += tl.sum(s.to(tl.float32) * (group_sums - z.to(tl.float32) * x_sums[None, :]), axis=1)
            else:
                acc += tl.sum(s.to(tl.float32) * (group_sums - HALF * x_sums[None, :]), axis=1)
    return acc


@triton.jit
def _int_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, N, k_per_split, stride_xm, stride_wn, stride_sn,
                     stride_om, BITS: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, GSZ: tl.constexpr,
                     HAS_ZEROS: tl.constexpr, ATOMIC: tl.constexpr, SILU_MUL: tl.constexpr, DUP: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # With SILU_MUL the weight is [gate | up] (2N rows) and the program writes silu(gate) * up for its N rows.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(1) * k_per_split
    row = tl.program_id(2)
    n_mask = offs_n < N
    x_row = x_ptr + row * stride_xm
    acc = _gemv_rows(x_row, w_ptr, s_ptr, z_ptr, offs_n, n_mask, k_begin, k_per_split, stride_wn, stride_sn, BITS,
                     GROUP, NG, GSZ, HAS_ZEROS, DUP, BLOCK_N, BLOCK_K)
    out = out_ptr + row * stride_om + offs_n
    if SILU_MUL:
        up = _gemv_rows(x_row, w_ptr, s_ptr, z_ptr, offs_n + N, n_mask, k_begin, k_per_split, stride_wn, stride_sn,
                        BITS, GROUP, NG, GSZ, HAS_ZEROS, DUP, BLOCK_N, BLOCK_K)
        # Rounded where the separate matmul and silu_mul kernels round, so the result is theirs.
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out, (silu * up.to(out_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=n_mask)
    elif ATOMIC:
        tl.atomic_add(out, acc, mask=n_mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _dequantized_tile(w_ptr, s_ptr, z_ptr, g_ptr, offs_n, n_mask, k0, stride_wn, stride_sn, BITS: tl.constexpr,
                      GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr, DUP: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """The weight's ``[BLOCK_K, len(offs_n)]`` tile at column ``k0``, dequantized to float32."""
    PACK: tl.constexpr = 32 // BITS
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if DUP:
        words = tl.load(w_ptr + offs_n[None, :] * stride_wn + (offs_k // PACK)[:, None], mask=n_mask[None, :],
                        other=0)
        q = ((words >> ((offs_k % PACK) * BITS)[:, None]) & ((1 << BITS) - 1)).to(tl.float32)
    else:
        offs_w = tl.arange(0, BLOCK_K // PACK)
        words = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 // PACK + offs_w)[None, :], mask=n_mask[:, None],
                        other=0)
        q = tl.trans(_unpack(words, BITS, PACK))
    g = tl.load(g_ptr + offs_k) if HAS_GIDX else offs_k // GROUP
    index = offs_n[None, :] * stride_sn + g[:, None]
    s = tl.load(s_ptr + index, mask=n_mask[None, :], other=0).to(tl.float32)
    if HAS_ZEROS:
        return (q - tl.load(z_ptr + index, mask=n_mask[None, :], other=0).to(tl.float32)) * s
    return (q - (1 << (BITS - 1))) * s


@triton.jit
def _int_dot_kernel(x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, out_ptr, M, N, k_per_split, stride_xm, stride_wn, stride_sn,
                    stride_om, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                    HAS_GIDX: tl.constexpr, ATOMIC: tl.constexpr, DUP: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = tl.program_id(2) * k_per_split
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + tl.arange(0, BLOCK_K))[None, :],
                    mask=m_mask[:, None], other=0)
        w = _dequantized_tile(w_ptr, s_ptr, z_ptr, g_ptr, offs_n, n_mask, k0, stride_wn, stride_sn, BITS, GROUP,
                              HAS_ZEROS, HAS_GIDX, DUP, BLOCK_K)
        acc = tl.dot(x, w.to(x.dtype), acc)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, stride_wn, stride_sn, stride_on, BITS: tl.constexpr,
                       GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_mask = offs_n < N
    w = _dequantized_tile(w_ptr, s_ptr, z_ptr, g_ptr, offs_n, n_mask, k0, stride_wn, stride_sn, BITS, GROUP,
                          HAS_ZEROS, HAS_GIDX, True, BLOCK_K)
    out = out_ptr + offs_n[None, :] * stride_on + (k0 + tl.arange(0, BLOCK_K))[:, None]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=n_mask[None, :])
