"""The grouped GEMM of W4A16 experts with ``magic_mma``'s widening (``kernels/packed_int_magic.py``): each program
takes ``block_n`` rows of one expert's packed weight and ``block_m`` of the rows sorted by expert
(``align_by_expert``), the weight as the dot's first operand (swap-AB: the tokens are the tensor cores' narrow
side), one panel (128 values a row) a K step. Each word's eight values become four pairs of 16-bit values, one shift
and one lop3 a pair in inline PTX, and (``scaled``) ``(u - zero) * scale`` by one packed subtraction and
multiplication, so the four dots of 32 columns a panel accumulate across steps with no per-group fix-up; the
widening is paid once per weight tile and ``block_m`` tokens, where ``kernels/packed_int_moe.py``'s ``_dot_panels``
widens value slot by value slot, through float32 where not 4-bit-in-bf16, for 16-row ``tl.dot``s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from treadle.kernels.packed_int import widening
from treadle.kernels.packed_int_magic import PANEL, _group_scale_zero, _pair


@dataclass(frozen=True)
class GroupedMagicTiles:
    """One launch: ``block_m`` sorted rows (which also pad each expert's run) by ``block_n`` weight rows a
    program; ``asm``: the widening in inline PTX (else the same values from plain ops, as the CPU interpreter
    needs); ``scaled``: the values dequantized before the dots (else each step's scale and zero after them)."""

    block_m: int
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    asm: bool = True
    scaled: bool = True

    def fits(self, k: int, bits: int, group: int, dtype: torch.dtype) -> bool:
        """Whether this launch tiles a K of ``k`` ``bits``-bit values in groups of ``group`` for ``dtype`` rows."""
        return bits == 4 and group % PANEL == 0 and k % PANEL == 0 and widening(bits, dtype)[0]


def magic_fits(hidden: int, inter: int, bits: int, group: int, dtype: torch.dtype) -> bool:
    """Whether both of an expert's GEMMs (K = ``hidden``, then ``inter``) run :func:`grouped_magic`."""
    return all(GroupedMagicTiles(16).fits(k, bits, group, dtype) for k in (hidden, inter))


def default_magic_tiles(num_rows: int, num_experts: int) -> GroupedMagicTiles:
    """Tiles by the mean rows per expert: token tiles about as tall as an expert's run (the padding of each run
    costs tensor-core work, a short tile the widening's amortization), 8 warps for the 64- and 128-row ones."""
    per_expert = num_rows / num_experts
    block_m = 16 if per_expert < 32 else 32 if per_expert < 64 else 64 if per_expert < 256 else 128
    return GroupedMagicTiles(block_m, 128, 8 if block_m >= 64 else 4)


def magic_trials(num_rows: int, num_experts: int) -> list[GroupedMagicTiles]:
    """The launches ``bench/quant_kernels.py --moe`` times at ``num_rows`` (sorted rows): the default, token tiles
    of half, the same and twice its rows (16 to 128) on 128 weight rows (4 or 8 warps), and the default's token tile
    on 64 weight rows, scaled after the dots, and with a fourth pipeline stage (at most ten, so the benchmark stays
    near two minutes)."""
    first = default_magic_tiles(num_rows, num_experts)
    listed = [first]
    for block_m in (first.block_m // 2, first.block_m, first.block_m * 2):
        if 16 <= block_m <= 128:
            listed += [GroupedMagicTiles(block_m, 128, 4), GroupedMagicTiles(block_m, 128, 8)]
    listed += [GroupedMagicTiles(first.block_m, 64, 4),
               GroupedMagicTiles(first.block_m, first.block_n, first.num_warps, scaled=False),
               GroupedMagicTiles(first.block_m, first.block_n, first.num_warps, num_stages=4)]
    return list(dict.fromkeys(listed))


def grouped_magic(a: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  out: torch.Tensor, sorted_rows: torch.Tensor, block_experts: torch.Tensor, a_row_divisor: int,
                  row_weights: torch.Tensor | None, bits: int, group: int, tiles: GroupedMagicTiles) -> None:
    """``out[r] = a[r // a_row_divisor] @ dequantized(weights[expert(r)]).T`` (times ``row_weights[r]``) for each
    sorted row ``r`` (blocks of ``tiles.block_m``)."""
    _, n, _ = weights.shape
    _, magic, offset = widening(bits, a.dtype)
    if not tiles.fits(a.shape[1], bits, group, a.dtype):
        raise ValueError(f"{tiles} does not run K={a.shape[1]} of {bits}-bit values in groups of {group} on {a.dtype}")
    _grouped_magic_kernel[(block_experts.numel(), triton.cdiv(n, tiles.block_n))](
        a, weights, scales, zeros if zeros is not None else scales, out,
        row_weights if row_weights is not None else out, sorted_rows, block_experts, n, a.shape[1], out.shape[0],
        a_row_divisor, a.stride(0), weights.stride(0), weights.stride(1), scales.stride(0), scales.stride(1),
        out.stride(0), GROUP=group, HAS_ZEROS=zeros is not None, MAGIC16=magic, OFFSET16=offset, ASM=tiles.asm,
        SCALED=tiles.scaled, MUL_ROW_WEIGHT=row_weights is not None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)


@triton.jit
def _sorted_block_rows(sorted_rows_ptr, pid_m, num_rows, a_row_divisor, BLOCK_M: tl.constexpr):
    """Block ``pid_m``'s sorted rows (64-bit), which of them are real (not padding), and the rows of the GEMM's
    input they read (``row // a_row_divisor``: a token's row for gate/up, the row itself for down)."""
    rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < num_rows
    return rows, row_mask, tl.where(row_mask, rows // a_row_divisor, 0)


@triton.jit(do_not_specialize=["num_rows"])
def _grouped_magic_kernel(a_ptr, w_ptr, s_ptr, z_ptr, c_ptr, row_weight_ptr, sorted_rows_ptr, block_experts_ptr, N,
                          K, num_rows, a_row_divisor, stride_am, stride_we, stride_wn, stride_se, stride_sn,
                          stride_cm, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, MAGIC16: tl.constexpr,
                          OFFSET16: tl.constexpr, ASM: tl.constexpr, SCALED: tl.constexpr,
                          MUL_ROW_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows, row_mask, a_rows = _sorted_block_rows(sorted_rows_ptr, pid_m, num_rows, a_row_divisor, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_tile = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + tl.arange(0, 16)[None, :]
    s_base, z_base = s_ptr + expert * stride_se, z_ptr + expert * stride_se
    # [16, 2, BLOCK_M] activations of pair p's columns (16 * (p + 4h) + c at [c, h]), as magic_mma's.
    x_pair = (a_ptr + a_rows[None, None, :] * stride_am + tl.arange(0, 16)[:, None, None]
              + 64 * tl.arange(0, 2)[None, :, None])
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, 128):
        words = tl.load(w_tile + k0 // 8, mask=n_mask[:, None], other=0, eviction_policy="evict_first")
        s, zero = _group_scale_zero(s_base, z_base, offs_n, n_mask, k0 // GROUP, stride_sn, 4, HAS_ZEROS,
                                    0.0 if SCALED else OFFSET16, BLOCK_N)
        if SCALED:
            for p in tl.static_range(4):
                x = tl.reshape(tl.load(x_pair + k0 + 16 * p, mask=row_mask[None, None, :], other=0), [32, BLOCK_M])
                w = tl.reshape(_pair(words, zero, s, p, MAGIC16, ASM, True, x.dtype), [BLOCK_N, 32])
                acc = tl.dot(w, x, acc)
        else:
            part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            x_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            for p in tl.static_range(4):
                x = tl.reshape(tl.load(x_pair + k0 + 16 * p, mask=row_mask[None, None, :], other=0), [32, BLOCK_M])
                w = tl.reshape(_pair(words, zero, s, p, MAGIC16, ASM, False, x.dtype), [BLOCK_N, 32])
                part = tl.dot(w, x, part)
                x_sum += tl.sum(x.to(tl.float32), axis=0)
            acc += s[:, None] * (part - zero[:, None] * x_sum[None, :])
    if MUL_ROW_WEIGHT:
        acc = acc * tl.load(row_weight_ptr + rows, mask=row_mask, other=0.0)[None, :]
    tl.store(c_ptr + rows[None, :] * stride_cm + offs_n[:, None], acc.to(c_ptr.dtype.element_ty),
             mask=n_mask[:, None] & row_mask[None, :])
