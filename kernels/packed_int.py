"""Triton kernels for integer weights with group scales (W4A16, W8A16), in ``layers/packed_int.py``'s panel layout:
``weight`` int32 ``[N, K * bits / 32]``, each row cut into panels of 16 words whose value ``j`` of word ``c`` is
the row's element ``16 * j + c`` of the panel (so the activations of one value slot of a panel's words are 16
contiguous columns), ``scales`` / ``zeros`` ``[N, groups]``.

- :func:`int_gemv` — one token: each program streams ``block_n`` rows, ``block_w`` words per step (the next step's
  words loaded before this one's arithmetic, 16 bytes a load), and turns each 4-bit value into float32 with one
  integer op (the value or'ed into the mantissa of 2**23, its power-of-two position folded into the activation)
  and one add, or (``IntTiles.subnormal``: the loader's 4-bit candidates but one control) with one and alone (the
  value's bits read as a float32 subnormal, exact, the activation taking the power of two); sums stay per word
  column in registers and meet their group's scale once per group, so the only cross-thread reduction is the last
  one. Split-K programs store float32 partials that the last of a tile's programs sums (no second kernel, no
  memset).
- :func:`int_dot` — 2 to ``DOT_MAX_ROWS`` rows: per panel, each value slot ``j`` of the words is widened to the
  activations' dtype in registers (4-bit: ``u | 0x4300`` read as bf16 is ``128 + u`` exactly, no conversion
  instruction) and multiplied on the tensor cores by the 16 activation columns it belongs to; each group's sums
  take its scale and zero (and the widening's offset, through the rows' activation sums) once.
- ``dequantize`` (``kernels/packed_int_dequant.py``) — larger batches (compute-bound): the 16-bit weight once per
  call, then the library matmul; also act-order weights whose sorted groups are not uniform (``g_idx``).

:func:`gemv_candidates` and :func:`tile_candidates` list the launch configs the loader may time per weight shape;
``kernels/int_kernel_plan.py`` holds what each shape runs (beside ``kernels/packed_int_mma.py``'s tiles).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any
import torch
import triton
import triton.language as tl

from treadle.kernels.pdl import allow_next, wait_for_previous
from treadle.kernels.pdl import enabled as pdl_enabled
from treadle.kernels.small_batch import _add_rmsnorm_when_last, _arrivals, _prefetch_share, _prefetching_programs

PANEL_WORDS = 16  # words per panel (layers/packed_int.py's pack_panels)
# Batches up to this many rows run the tiles that widen the weight in registers; larger ones dequantize it once
# per call and run the library matmul.
DOT_MAX_ROWS = 256


@dataclass(frozen=True)
class IntTiles:
    """One launch's tiles: ``block_m`` 0 means the GEMV; ``block_w`` packed words per row per K step (a multiple of
    the 16-word panel; the tiles of ``int_dot`` take one panel per step); ``split_k`` K ranges whose float32
    partials the last program of a tile sums; ``i16``: ``int_dot`` widens 4-bit values with integer ops alone;
    ``subnormal``: the GEMV widens 4-bit values as subnormals (``_subnormal_times_x``)."""

    block_m: int
    block_n: int
    block_w: int = PANEL_WORDS
    split_k: int = 1
    num_warps: int = 4
    i16: bool = False
    subnormal: bool = False


def tiles_shape(k: int, bits: int, group: int) -> bool:
    """Whether the kernels take a K of ``k`` ``bits``-bit values in groups of ``group``: whole panels, and groups
    that are whole value slots of a panel (16 columns each) or whole panels."""
    panel = PANEL_WORDS * 32 // bits
    return k % panel == 0 and group % 16 == 0 and (panel % group == 0 or group % panel == 0)


def gemv_candidates(n: int, k: int, bits: int, sm_count: int) -> list[IntTiles]:
    """One-token GEMV configs for an ``n`` x ``k`` weight: rows per program, words per step and warps such that each
    thread holds several rows of the same columns (the activations it widens serve them all), split-K where the
    row tiles alone leave the GPU short of programs to keep the memory busy; 4-bit ones widen as subnormals."""
    words = k * bits // 32
    # First (what runs untimed): the H100 sweep's best at all four of Llama-3.1-8B's shapes, 8 rows by 64 words a
    # one-warp program, split-K for 12 programs per SM (72.1 us for the four against 71.5 for each shape's best);
    # then two panels a step (o_proj's and down_proj's best kind in the round-1 sweep).
    listed = [IntTiles(0, 8, 64, _split(n, words, 8, 64, 12 * sm_count), 1)] if words % 64 == 0 else []
    if words % 128 == 0:
        split = _split(n, words, 8, 128, 4 * sm_count)
        listed += [IntTiles(0, 8, 128, split, 1), IntTiles(0, 8, 128, max(split // 2, 1), 1)]
    for block_n, block_w, warps in ((16, 16, 1), (16, 32, 1), (32, 16, 2), (16, 32, 2), (32, 32, 4), (8, 32, 1)):
        if words % block_w:
            continue
        split = _split(n, words, block_n, block_w, 4 * sm_count)
        listed += [IntTiles(0, block_n, block_w, split, warps),
                   IntTiles(0, block_n, block_w, max(split // 2, 1), warps)]
    listed = list(dict.fromkeys(listed))
    if bits != 4:
        return listed
    # 4-bit: every config with the subnormal widening (faster than the plain one at every shape and config the
    # round-1 sweep timed, as exact) and the first plain one as a control.
    return [dataclasses.replace(tiles, subnormal=True) for tiles in listed] + listed[:1]


def tile_candidates(n: int, k: int, bits: int, rows: int, sm_count: int) -> list[IntTiles]:
    """``tl.dot`` tile configs for batches of about ``rows`` tokens (one panel per K step): as many tile rows as the
    batch has, up to 64 (the tensor cores' work on padding rows is not free at 32)."""
    words = k * bits // 32
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    shapes = ((64, 4), (32, 4), (128, 4)) if rows <= 16 else ((64, 4), (128, 8), (32, 4))
    candidates = []
    for block_n, warps in shapes:
        split = _split(n, words, block_n, PANEL_WORDS, 2 * sm_count)
        for i16 in ((True, False) if bits == 4 else (False,)):
            tiles = IntTiles(block_m, block_n, PANEL_WORDS, split, warps, i16)
            if tiles not in candidates:
                candidates.append(tiles)
    return candidates


def _split(n: int, words: int, block_n: int, block_w: int, programs: int) -> int:
    tiles, split = triton.cdiv(n, block_n), 1
    while tiles * split < programs and split < 8 and words % (2 * split * block_w) == 0:
        split *= 2
    return split


def int_gemv(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
             group: int, tiles: IntTiles, silu_mul: bool = False,
             add_rmsnorm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
             prefetch: torch.Tensor | None = None) -> Any:
    """``x [1, K] @ dequantized(weight).T``. With ``silu_mul`` (no split-K) the weight is ``[gate | up]`` and the
    result ``silu(gate) * up``, in one kernel. With ``add_rmsnorm`` = ``(residual, norm_weight, eps)`` the result
    is ``(rmsnorm(y + residual) * norm_weight, y + residual)`` instead, computed by the program that stores the
    row's last tile (the layer's next norm needs no kernel of its own). ``prefetch``: the head of the weight the
    model reads next (``layers/small_batch.py``'s ``l2_prefetch_bytes``), which the last programs ask L2 for as
    they finish, as the 16-bit small-batch kernels do."""
    k = x.shape[1]
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, tiles.block_n), tiles.split_k)
    partials = _partials(tiles.split_k, 1, n, x.device)
    if add_rmsnorm is not None:
        residual, norm_weight, eps = add_rmsnorm
        residual, normed, residual_out = residual.contiguous(), torch.empty_like(out), torch.empty_like(out)
    else:
        residual = norm_weight = normed = residual_out = out  # unread placeholders
        eps = 0.0
    pdl = pdl_enabled(x.device)
    _int_gemv_kernel[grid](
        # One counter per output tile, and one after them for the row's norm.
        x, weight, scales, zeros if zeros is not None else scales, out, partials, _arrivals(x.device, grid[0] + 1),
        residual, norm_weight, normed, residual_out, eps, n, k // tiles.split_k, weight.stride(0), scales.stride(0),
        BITS=bits, GROUP=group, HAS_ZEROS=zeros is not None, SPLIT_K=tiles.split_k, SILU_MUL=silu_mul,
        ADD_RMSNORM=add_rmsnorm is not None, BLOCK_ROW=triton.next_power_of_2(n) if add_rmsnorm is not None else 1,
        BLOCK_N=tiles.block_n, BLOCK_W=tiles.block_w, PDL=pdl, SUBNORMAL=tiles.subnormal and bits == 4,
        **prefetch_args(prefetch, grid[0] * grid[1], weight), launch_pdl=pdl, num_warps=tiles.num_warps)
    return out if add_rmsnorm is None else (normed, residual_out)


def prefetch_args(prefetch: torch.Tensor | None, programs: int, weight: torch.Tensor) -> dict[str, Any]:
    """The kernel arguments of an L2 prefetch of ``prefetch`` (None: none) shared by the last programs of a launch
    of ``programs`` (``kernels/small_batch.py``'s ``_prefetch_share``; ``weight`` stands in for the pointer when
    there is nothing to fetch)."""
    lines = prefetch.numel() // 128 if prefetch is not None else 0
    first = max(programs - _prefetching_programs(weight.device), 0) if lines else 0
    return dict(prefetch_ptr=prefetch if lines else weight, prefetch_lines=lines, first_prefetcher=first,
                PREFETCH=lines > 0, PREFETCH_BLOCK=min(256, triton.next_power_of_2(max(
                    triton.cdiv(lines, max(programs - first, 1)), 1))))


def int_dot(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
            group: int, tiles: IntTiles) -> torch.Tensor:
    """``x [M, K] @ dequantized(weight).T``, each panel's values widened in registers and multiplied by ``tl.dot``."""
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(rows, tiles.block_m), tiles.split_k)
    i16, magic, offset = widening(bits, x.dtype, tiles.i16)
    _int_dot_kernel[grid](
        x, weight, scales, zeros if zeros is not None else scales, out, _partials(tiles.split_k, rows, n, x.device),
        _arrivals(x.device, grid[0] * grid[1]), rows, n, k // tiles.split_k, x.stride(0), weight.stride(0),
        scales.stride(0), out.stride(0), BITS=bits, GROUP=group, HAS_ZEROS=zeros is not None,
        SPLIT_K=tiles.split_k, I16=i16, MAGIC16=magic, OFFSET16=offset, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, num_warps=tiles.num_warps)
    return out


def widening(bits: int, dtype: torch.dtype, i16: bool = True) -> tuple[bool, int, float]:
    """``(I16, MAGIC16, OFFSET16)`` of the ``tl.dot`` kernels: 4-bit values widen to 16-bit activations with integer
    ops alone (or'ed into the mantissa of bf16 128.0 / fp16 1024.0, whose value they then add to), else through
    float32."""
    if i16 and bits == 4 and dtype in _MAGIC16:
        return (True, *_MAGIC16[dtype])
    return False, 0, 0.0


_MAGIC16 = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}


def _partials(split_k: int, rows: int, n: int, device: torch.device) -> torch.Tensor:
    if split_k == 1:
        return torch.empty(1, dtype=torch.float32, device=device)
    return torch.empty(split_k, rows, n, dtype=torch.float32, device=device)


@triton.jit
def _slot_times_x(words, x, J: tl.constexpr, BITS: tl.constexpr, CENTERED: tl.constexpr):
    """``(u - 2**(BITS-1)) * x`` (``u * x`` unless ``CENTERED``) for value slot ``J`` of each word, ``x`` float32 per
    word column. The value becomes float32 ``2**23 + u * 2**SHIFT`` with one and-or where it may stay at its bit
    position ``SHIFT`` (below bit 23), a shift too where it may not (then ``SHIFT`` is 0); subtracting the exact
    ``2**23 (+ HALF * 2**SHIFT)`` leaves ``(u - HALF) * 2**SHIFT`` exactly, and the power of two moves onto ``x``."""
    MASK: tl.constexpr = (1 << BITS) - 1
    SHIFT: tl.constexpr = BITS * J if BITS * J + BITS <= 23 else 0
    BIAS: tl.constexpr = 8388608.0 + (1 << (BITS - 1)) * (1 << SHIFT) if CENTERED else 8388608.0
    if BITS * J + BITS <= 23:
        bits = (words & (MASK << (BITS * J))) | 0x4B000000
    else:
        bits = ((words >> (BITS * J)) & MASK) | 0x4B000000
    return (bits.to(tl.float32, bitcast=True) - BIAS) * (x * (1.0 / (1 << SHIFT)))[None, :]


@triton.jit
def _fold_scales(s_ptr, z_ptr, offs_n, n_mask, panel_base, k_first, stride_sn, GROUP: tl.constexpr,
                 HAS_ZEROS: tl.constexpr, ONE_PANEL: tl.constexpr):
    """float32 ``(scale, zero)`` of the rows ``offs_n`` for the group holding K offset ``k_first`` of each word
    column's panel (``panel_base``): ``[BLOCK_N, 1]`` with one panel a step, else ``[BLOCK_N, BLOCK_W]``; the zero
    is the scale, unread, without zero points."""
    if ONE_PANEL:
        g = k_first // GROUP
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0).to(tl.float32)[:, None]
        z = s
        if HAS_ZEROS:
            z = tl.load(z_ptr + offs_n * stride_sn + g, mask=n_mask, other=0).to(tl.float32)[:, None]
    else:
        index = offs_n[:, None] * stride_sn + ((k_first + panel_base) // GROUP)[None, :]
        s = tl.load(s_ptr + index, mask=n_mask[:, None], other=0).to(tl.float32)
        z = s
        if HAS_ZEROS:
            z = tl.load(z_ptr + index, mask=n_mask[:, None], other=0).to(tl.float32)
    return s, z


@triton.jit
def _subnormal_times_x(words, x, J: tl.constexpr):
    """``u * x * 2**-60`` exactly for 4-bit value slot ``J`` of each word, ``x`` float32 per word column: the value's
    four bits alone (the word shifted by 16 first for slots 4-7), one and, read as float32 are the subnormal
    ``u * 2**(4P - 149)`` (``P = J % 4``), and ``x`` takes ``2**(89 - 4P)`` (FMAs keep subnormals: Triton's are
    not .ftz)."""
    P: tl.constexpr = J % 4
    if J < 4:
        value = (words & (15 << (4 * P))).to(tl.float32, bitcast=True)
    else:
        value = ((words >> 16) & (15 << (4 * P))).to(tl.float32, bitcast=True)
    if P == 0:
        scaled = x * 618970019642690137449562112.0  # 2**89
    elif P == 1:
        scaled = x * 38685626227668133590597632.0  # 2**85
    elif P == 2:
        scaled = x * 2417851639229258349412352.0  # 2**81
    else:
        scaled = x * 151115727451828646838272.0  # 2**77
    return value * scaled[None, :]


@triton.jit
def _gemv_rows(x_ptr, w_ptr, s_ptr, z_ptr, offs_n, n_mask, k_begin, k_per_split, stride_wn, stride_sn,
               BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_W: tl.constexpr, PDL: tl.constexpr, SUBNORMAL: tl.constexpr = False):
    """float32 sums of the activation row with the weight rows ``offs_n`` over one K range. ``SUBNORMAL`` (4-bit):
    each value times its activation by :func:`_subnormal_times_x` (one and and one FMA a value), the zero (the
    symmetric 8 without zero points) through the activations' sum, and ``2**60`` once at the end."""
    PACK: tl.constexpr = 32 // BITS
    PANEL: tl.constexpr = 16 * PACK
    STEP: tl.constexpr = BLOCK_W * PACK
    JG: tl.constexpr = GROUP // 16 if GROUP // 16 < PACK else PACK  # value slots per group fold
    ONE_PANEL: tl.constexpr = BLOCK_W == 16
    offs_w = tl.arange(0, BLOCK_W)
    panel_base = (offs_w // 16) * PANEL  # each word column's panel, as a K offset within the step
    x_cols = panel_base + offs_w % 16
    w_rows = w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :]
    k_end = k_begin + k_per_split
    # Word offsets are whole steps (multiples of the 16-word panel): said so, the loads are 16-byte vectors (the
    # first offset as k_end - k_per_split: a tensor to hint even where a caller passes k_begin as the constant 0).
    words = tl.load(w_rows + tl.multiple_of((k_end - k_per_split) // PACK, 16), mask=n_mask[:, None], other=0,
                    eviction_policy="evict_first")
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    for k0 in range(k_begin, k_end, STEP):
        # The next step's words (the last step reloads its own: an L2 hit instead of a predicate).
        upcoming = tl.load(w_rows + tl.multiple_of(tl.minimum(k0 + STEP, k_end - STEP) // PACK, 16),
                           mask=n_mask[:, None], other=0, eviction_policy="evict_first")
        part = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        x_sum = tl.zeros([BLOCK_W], dtype=tl.float32)
        for j in tl.static_range(PACK):
            x = tl.load(x_ptr + tl.multiple_of(k0, 16) + x_cols + 16 * j).to(tl.float32)
            if SUBNORMAL:
                part += _subnormal_times_x(words, x, j)
                x_sum += x * 8.673617379884035e-19  # 2**-60, part's scale
            else:
                part += _slot_times_x(words, x, j, BITS, not HAS_ZEROS)
                if HAS_ZEROS:
                    x_sum += x
            if (j + 1) % JG == 0:
                s, z = _fold_scales(s_ptr, z_ptr, offs_n, n_mask, panel_base, k0 + 16 * (j + 1 - JG), stride_sn,
                                    GROUP, HAS_ZEROS, ONE_PANEL)
                if HAS_ZEROS:
                    acc += s * (part - z * x_sum[None, :])
                    x_sum = tl.zeros([BLOCK_W], dtype=tl.float32)
                elif SUBNORMAL:
                    acc += s * (part - 8.0 * x_sum[None, :])
                    x_sum = tl.zeros([BLOCK_W], dtype=tl.float32)
                else:
                    acc += s * part
                part = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        words = upcoming
    if SUBNORMAL:
        return tl.sum(acc, axis=1) * 1152921504606846976.0  # 2**60
    return tl.sum(acc, axis=1)


@triton.jit
def _int_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, partials_ptr, arrivals_ptr, residual_ptr, norm_weight_ptr,
                     normed_ptr, residual_out_ptr, eps, N, k_per_split, stride_wn, stride_sn, BITS: tl.constexpr,
                     GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, SPLIT_K: tl.constexpr, SILU_MUL: tl.constexpr,
                     ADD_RMSNORM: tl.constexpr, BLOCK_ROW: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_W: tl.constexpr, PDL: tl.constexpr, SUBNORMAL: tl.constexpr, prefetch_ptr,
                     prefetch_lines, first_prefetcher, PREFETCH: tl.constexpr, PREFETCH_BLOCK: tl.constexpr):
    # With SILU_MUL the weight is [gate | up] (2N rows) and the program writes silu(gate) * up for its N rows.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_begin = pid_k * k_per_split
    acc = _gemv_rows(x_ptr, w_ptr, s_ptr, z_ptr, offs_n, n_mask, k_begin, k_per_split, stride_wn, stride_sn, BITS,
                     GROUP, HAS_ZEROS, BLOCK_N, BLOCK_W, PDL, SUBNORMAL)
    if SILU_MUL:
        up = _gemv_rows(x_ptr, w_ptr, s_ptr, z_ptr, offs_n + N, n_mask, k_begin, k_per_split, stride_wn, stride_sn,
                        BITS, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_W, False, SUBNORMAL)
        allow_next(PDL)
        # Rounded where the separate matmul and silu_mul kernels round, so the result is theirs.
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + offs_n, (silu * up.to(out_ptr.dtype.element_ty).to(tl.float32))
                 .to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        allow_next(PDL)
        stored = _store_or_reduce(acc, out_ptr + offs_n, partials_ptr + offs_n, N, arrivals_ptr + pid_n, n_mask,
                                  pid_k, SPLIT_K)
        if ADD_RMSNORM:
            if stored:
                _add_rmsnorm_when_last(out_ptr, arrivals_ptr, residual_ptr, norm_weight_ptr, normed_ptr,
                                       residual_out_ptr, eps, N, BLOCK_ROW)
    if PREFETCH:  # the next weight's head into L2 as the last programs finish
        _prefetch_share(prefetch_ptr, prefetch_lines, first_prefetcher, PREFETCH_BLOCK)


@triton.jit
def _store_or_reduce(acc, out, partials, split_stride, arrival, mask, pid_k, SPLIT_K: tl.constexpr):
    """Store ``acc``; with split-K each program stores its float32 partial and counts itself in, and the last of
    the tile's programs to arrive (the count's release/acquire makes the others' stores visible) sums the partials
    and resets the count for the next call. Returns whether this program stored the tile."""
    if SPLIT_K == 1:
        tl.store(out, acc.to(out.dtype.element_ty), mask=mask)
        last = True
    else:
        tl.store(partials + pid_k * split_stride, acc, mask=mask)
        tl.debug_barrier()  # every thread's part is stored before the count releases it
        last = tl.atomic_add(arrival, 1, sem="acq_rel") == SPLIT_K - 1
        if last:
            total = tl.load(partials, mask=mask, other=0.0, cache_modifier=".cg")
            for split in tl.static_range(1, SPLIT_K):
                total += tl.load(partials + split * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(arrival, 0, sem="relaxed")
            tl.store(out, total.to(out.dtype.element_ty), mask=mask)
    return last


@triton.jit
def _widened(words, J: tl.constexpr, BITS: tl.constexpr, I16: tl.constexpr, MAGIC16: tl.constexpr, dtype):
    """Value slot ``J`` of each word in ``dtype``: ``u + OFFSET16`` from integer ops alone (I16), else ``u``."""
    MASK: tl.constexpr = (1 << BITS) - 1
    if I16:
        return (((words >> (BITS * J)) & MASK) | MAGIC16).to(tl.int16).to(dtype, bitcast=True)
    bits = ((words >> (BITS * J)) & MASK) | 0x4B000000
    return (bits.to(tl.float32, bitcast=True) - 8388608.0).to(dtype)


@triton.jit
def _group_scale_zero(s_ptr, z_ptr, offs_n, n_mask, g, stride_sn, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                      OFFSET16: tl.constexpr, BLOCK_N: tl.constexpr):
    """Group ``g``'s float32 scale of each weight row, and its zero plus the widening's offset (the symmetric
    zero ``2**(BITS-1)`` without zero points)."""
    s = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + offs_n * stride_sn + g, mask=n_mask, other=0).to(tl.float32) + OFFSET16
    else:
        zero = tl.full([BLOCK_N], (1 << (BITS - 1)) + OFFSET16, tl.float32)
    return s, zero


@triton.jit
def _dot_panels(x_rows, m_mask, w_cols, s_ptr, z_ptr, offs_n, n_mask, k_begin, k_end, stride_sn, BITS: tl.constexpr,
                GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, I16: tl.constexpr, MAGIC16: tl.constexpr,
                OFFSET16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """float32 ``[BLOCK_M, BLOCK_N]`` sums of the activation rows (``x_rows``: their first 16 columns' pointers)
    with the weight rows (``w_cols``: ``[16, BLOCK_N]`` pointers to a row's first panel, transposed) over
    ``[k_begin, k_end)``: per panel, value slot ``j`` of its words times the 16 activation columns it holds; each
    group's sums take its scale, and its zero (plus the widening's offset) through the rows' activation sums."""
    PACK: tl.constexpr = 32 // BITS
    PANEL: tl.constexpr = 16 * PACK
    JG: tl.constexpr = GROUP // 16 if GROUP // 16 < PACK else PACK
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, PANEL):
        words = tl.load(w_cols + k0 // PACK, mask=n_mask[None, :], other=0, eviction_policy="evict_first")
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        x_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        for j in tl.static_range(PACK):
            x = tl.load(x_rows + k0 + 16 * j, mask=m_mask[:, None], other=0)
            part = tl.dot(x, _widened(words, j, BITS, I16, MAGIC16, x.dtype), part)
            x_sum += tl.sum(x.to(tl.float32), axis=1)
            if (j + 1) % JG == 0:
                s, zero = _group_scale_zero(s_ptr, z_ptr, offs_n, n_mask, (k0 + 16 * (j + 1 - JG)) // GROUP,
                                            stride_sn, BITS, HAS_ZEROS, OFFSET16, BLOCK_N)
                acc += s[None, :] * (part - x_sum[:, None] * zero[None, :])
                part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                x_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    return acc


@triton.jit(do_not_specialize=["M"])  # one compile for every batch size
def _int_dot_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, partials_ptr, arrivals_ptr, M, N, k_per_split, stride_xm,
                    stride_wn, stride_sn, stride_om, BITS: tl.constexpr, GROUP: tl.constexpr,
                    HAS_ZEROS: tl.constexpr, SPLIT_K: tl.constexpr, I16: tl.constexpr, MAGIC16: tl.constexpr,
                    OFFSET16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, 16)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_begin = pid_k * k_per_split
    acc = _dot_panels(x_ptr + offs_m[:, None] * stride_xm + offs_c[None, :], m_mask,
                      w_ptr + offs_n[None, :] * stride_wn + offs_c[:, None], s_ptr, z_ptr, offs_n, n_mask, k_begin,
                      k_begin + k_per_split, stride_sn, BITS, GROUP, HAS_ZEROS, I16, MAGIC16, OFFSET16, BLOCK_M,
                      BLOCK_N)
    tile = offs_m[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    _store_or_reduce(acc, out_ptr + tile, partials_ptr + offs_m[:, None] * N + offs_n[None, :], M * N,
                     arrivals_ptr + pid_m * tl.num_programs(0) + pid_n, mask, pid_k, SPLIT_K)
