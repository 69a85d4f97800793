"""A W4A16 tensor-core kernel for 2 to 64 tokens whose widened weight tile is in natural K order
(``kernels/packed_int.py``'s panel layout, unchanged), raced at load beside ``kernels/packed_int_magic.py``'s
``magic_mma``; on an H200 it won every Llama-3.1-8B shape at 16, 32 and 64 tokens (1.80x / 1.43x / 1.19x bf16's
linear work against ``magic_mma``'s 1.25x / 0.99x / 0.61x, 2026-11-28, docs/quantization.md).

:func:`natural_mma` (swap-AB: the weight is the dot's first operand, the tokens its narrow side): per panel (128
values a row, one K step) each pair of adjacent words ``2i`` and ``2i + 1`` becomes, by one ``prmt`` per half,
a register holding the low (or high) 16 bits of both; one shift and one lop3 (``& 0x000F000F | 0x43004300``)
make of it the bf16 pair ``128 + u`` of value slot ``j`` of both words, that is of the panel's columns
``16j + 2i`` and ``16j + 2i + 1`` (fp16: ``1024 + u``), and a packed subtraction and multiplication
``(u - zero) * scale``, rounded once as ``kernels/packed_int_dequant.py``'s ``dequantize`` rounds. Two values a
register in natural K order are what Hopper's wgmma reads as its first operand from registers, so the panel's
activations load as a plain ``[128, tokens]`` tile that Triton's pipeline copies (cp.async) straight into shared
memory in the layout the MMA reads, and the panel is one dot: Triton splits it into eight wgmmas of K 16 that
chain without waiting for each other (it makes a dot asynchronous only when nothing in the loop but the next
iteration reads its result; ``magic_mma``'s four chained dots a panel are each waited for, and its pairs, columns
``16p + c`` and ``16(p + 4) + c``, need their activation tile re-laid out through shared memory). The next step's
group scale loads a step ahead. Launched with PDL on Hopper (``kernels/pdl.py``), as the 16-bit small-batch tiles
are: L2 fetches the program's first two panels while the kernel before finishes. Split-K where the weight's row
tiles leave the SMs short of programs (up to 16 K ranges); the last program of a tile sums the float32 partials in
a loop, a chunk of them at a time (an unrolled sum of eight 32-token partials took ``magic_mma`` 255 registers and
spilled). ``python -m treadle.bench.mma_sass`` shows the loops in sm_90 SASS.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from treadle.kernels.packed_int import PANEL_WORDS, _partials, prefetch_args, widening
from treadle.kernels.packed_int_magic import scaled_pair
from treadle.kernels.pdl import allow_next, wait_for_previous
from treadle.kernels.pdl import enabled as pdl_enabled
from treadle.kernels.small_batch import _arrivals, _prefetch_share
from treadle.kernels.small_batch_loops import _prefetch_tile_head

PANEL = PANEL_WORDS * 8  # 4-bit values per panel


@dataclass(frozen=True)
class NaturalMmaTiles:
    """One :func:`natural_mma` launch: ``block_m`` tokens (16, 32 or 64) by ``block_n`` weight rows (64 a warp
    group) a tile, one panel a K step, ``split_k`` K ranges, ``num_stages`` pipeline stages of the packed words and
    activations; ``asm``: the widening in inline PTX (else the same values from plain ops, the CPU interpreter's);
    ``max_registers`` a thread (0: the compiler's choice), to fit more programs on an SM (65536 registers: 128 a
    thread of 4 warps fit four, 168 three); ``head_lines``: the 128-byte lines of each weight row (two panels a
    line) that a program launched early by PDL asks L2 for before the kernel before it finishes."""

    block_m: int
    block_n: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    asm: bool = True
    max_registers: int = 0
    head_lines: int = 2

    def fits(self, k: int, bits: int, group: int) -> bool:
        """Whether this launch tiles a K of ``k`` of ``bits``-bit values in groups of ``group``."""
        return bits == 4 and group % PANEL == 0 and k % (PANEL * self.split_k) == 0

    def sum_chunk(self) -> int:
        """Split-K partials the last program loads at once: 128 float32 registers a thread of them."""
        per_thread = max(self.block_n * self.block_m // (32 * self.num_warps), 1)
        return max(min(self.split_k, 128 // per_thread), 1)


def natural_mma(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                group: int, tiles: NaturalMmaTiles, prefetch: torch.Tensor | None = None,
                silu_mul: bool = False) -> torch.Tensor:
    """``x [M, K] @ dequantized(weight).T`` (4-bit, 16-bit activations) on the tensor cores, the weight tile
    widened in natural K order (module docstring); ``prefetch`` as :func:`~treadle.kernels.packed_int.int_gemv`'s.
    ``silu_mul`` (no split-K): the weight is ``[gate | up]`` and the result ``silu(gate) * up``, rounded where the
    matmul and ``kernels/fused.py``'s ``silu_mul`` round it: each program stores its tile of the matmul's output, the
    later of a gate tile and its up tile multiplies the two (a launch and a read of the matmul's output fewer)."""
    rows, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    i16, magic, _ = widening(bits, x.dtype)
    if not i16 or not tiles.fits(k, bits, group) or (silu_mul and (tiles.split_k != 1 or weight.shape[0] % 2)):
        raise ValueError(f"{tiles} does not run K={k} of {bits}-bit values in groups of {group} on {x.dtype}"
                         + (" as [gate | up] (no split-K, rows in pairs)" if silu_mul else ""))
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = ((2 if silu_mul else 1) * triton.cdiv(n, tiles.block_n), triton.cdiv(rows, tiles.block_m), tiles.split_k)
    pdl = pdl_enabled(x.device)
    if silu_mul:  # the matmul's output, where each program's tile waits for its pair's
        partials = torch.empty(rows, 2 * n, dtype=x.dtype, device=x.device)
    else:
        partials = _partials(tiles.split_k, rows, n, x.device)
    _natural_mma_kernel[grid](
        x, weight, scales, zeros if zeros is not None else scales, out, partials,
        _arrivals(x.device, grid[0] * grid[1]), rows, n, k // tiles.split_k, x.stride(0), weight.stride(0),
        scales.stride(0), out.stride(0), GROUP=group, HAS_ZEROS=zeros is not None, SPLIT_K=tiles.split_k,
        SUM_CHUNK=tiles.sum_chunk(), MAGIC16=magic, ASM=tiles.asm, EVEN_N=n % tiles.block_n == 0,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, PDL=pdl,
        **prefetch_args(prefetch, grid[0] * grid[1] * grid[2], weight), launch_pdl=pdl, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, HEAD_LINES=tiles.head_lines, SILU_MUL=silu_mul,
        **({"maxnreg": tiles.max_registers} if tiles.max_registers else {}))
    return out


def natural_candidates(n: int, k: int, bits: int, group: int, rows: int, sm_count: int) -> list[NaturalMmaTiles]:
    """The :func:`natural_mma` launches the loader times for a batch of about ``rows`` (after ``magic_mma``'s):
    the narrowest token tile that holds it, 128 weight rows a tile on one warp group, split-K for two programs
    per SM, one, then four (up to 16 K ranges: the last wave of programs shorter), four pipeline stages; at 16
    tokens also 128 registers a thread, four programs an SM (sm_90 SASS: no spills; 146 without the cap, three).
    Then the most K ranges whose programs the SMs hold at once (:func:`wave_split`) at three pipeline stages (the
    2026-11-28 H200 sweep's best for qkv_proj at 16 and 32 tokens, 9.4 / 13.2 µs against four stages' 10.6 /
    15.2), and that split halved at four stages (o_proj's best at 32 tokens on an H200 in the next sweep: 9.3 µs
    against 11.8-12.2 for the others)."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    steps = k // PANEL
    listed = [NaturalMmaTiles(block_m, 128, _split_k(n, steps, 128, programs * sm_count)) for programs in (2, 1, 4)]
    if block_m == 16:
        listed.insert(1, dataclasses.replace(listed[0], max_registers=128))
    resident = 2 if block_m > 32 else 3
    wave = wave_split(n, k, resident, sm_count)
    listed += [NaturalMmaTiles(block_m, 128, wave, num_stages=3), NaturalMmaTiles(block_m, 128, max(wave // 2, 1))]
    return [t for t in dict.fromkeys(listed) if t.fits(k, bits, group)]


def natural_trials(n: int, k: int, rows: int, sm_count: int) -> list[NaturalMmaTiles]:
    """The :func:`natural_mma` launches the sweep times for ``rows`` tokens (2 to 64), 128 weight rows a tile (one
    warp group): the loader's (split-K for two, one or four programs per SM; the most K ranges whose programs the
    SMs hold at once, :func:`wave_split`, at three stages, and half that at four); that wave split also with four
    and two pipeline stages, with registers capped (128 a thread up to 32 tokens, 168 at 64: a few spills in the
    loop past 16), with PDL's early L2 request of each row's first 16 panels, not 4 (``head_lines``); the most K
    ranges the SMs hold at once with registers capped for a program more an SM. Lost on an H200 and no longer
    timed (2026-11-28 sweeps, ``bench/results``): two warp groups (256 rows), six stages, the partials added by
    L2's atomic units (wrong on the GPU as written, and not deterministic), the next kernel let in before the loop,
    the weight re-laid out so that a tile's K step is contiguous (3% faster at gate_up_proj, slower elsewhere).
    (64-row tiles on one warp group compile with the widened values moved between threads through shared memory
    and every wgmma waited for: not timed.)"""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    steps = k // PANEL

    def tiles(programs: int = 0, stages: int = 4, registers: int = 0, fewer: int = 1, head: int = 2,
              per_sm: int = 0) -> NaturalMmaTiles:
        split = (_split_k(n, steps, 128, programs * sm_count) if programs
                 else wave_split(n, k, per_sm or (2 if block_m > 32 else 3), sm_count))
        return NaturalMmaTiles(block_m, 128, max(split // fewer, 1), 4, stages, max_registers=registers,
                               head_lines=head)

    capped = 168 if block_m == 64 else 128  # a program more an SM: 4 of 128 registers a thread, 3 of 168
    more = 3 if block_m == 64 else 4
    listed = [tiles(2), tiles(1), tiles(4), tiles(), tiles(stages=2), tiles(stages=3), tiles(registers=capped),
              tiles(fewer=2), tiles(head=8), tiles(per_sm=more, registers=capped)]
    return [t for t in dict.fromkeys(listed) if t.fits(k, 4, 128)]


def wave_split(n: int, k: int, per_sm: int, sm_count: int) -> int:
    """The most K ranges (a power of two up to 16) whose programs of 128 weight rows the SMs hold at once,
    ``per_sm`` an SM (uncapped, three up to 32 tokens and two at 64: sm_90 SASS, 146, 167 and 240 registers a thread
    of 128). With three or two, the fastest split of every Llama-3.1-8B shape at 16 (but down_proj's), 32 and 64
    tokens on an H200 (2026-11-28 sweep)."""
    slots, tiles, steps, split = per_sm * sm_count, triton.cdiv(n, 128), k // PANEL, 1
    while tiles * split * 2 <= slots and split < 16 and steps % (2 * split) == 0:
        split *= 2
    return split


def _split_k(n: int, steps: int, block_n: int, programs: int) -> int:
    """K ranges (a power of two up to 16, each whole steps) for at least ``programs`` programs: the last program's
    sum of the partials is a loop, so 16 of them cost no registers (o_proj and down_proj's 32 row tiles)."""
    split = 1
    while triton.cdiv(n, block_n) * split < programs and split < 16 and steps % (2 * split) == 0:
        split *= 2
    return split


# prmt selectors: the low (0x5410) or high (0x7632) halves of two words side by side in one register.
_HALVES_LOW = tl.constexpr("prmt.b32 $0, $1, $2, 0x5410;")
_HALVES_HIGH = tl.constexpr("prmt.b32 $0, $1, $2, 0x7632;")


@triton.jit
def _halves(even, odd, HIGH: tl.constexpr, ASM: tl.constexpr):
    """``[BLOCK_N, 8]`` int32: the low (``HIGH``: high) 16 bits of each even word below those of the next word."""
    if ASM:
        if HIGH:
            return tl.inline_asm_elementwise(_HALVES_HIGH, "=r,r,r", [even, odd], dtype=tl.int32, is_pure=True,
                                             pack=1)
        return tl.inline_asm_elementwise(_HALVES_LOW, "=r,r,r", [even, odd], dtype=tl.int32, is_pure=True, pack=1)
    if HIGH:
        return ((even >> 16) & 0xFFFF) | (odd & -65536)
    return (even & 0xFFFF) | (odd << 16)


@triton.jit
def _slot(halves, zero, scale, P: tl.constexpr, MAGIC16: tl.constexpr, ASM: tl.constexpr, dtype: tl.constexpr):
    """``[BLOCK_N, 8, 2]``: ``(u - zero) * scale`` in ``dtype`` of the four bits at ``4P`` (and ``16 + 4P``) of each
    register of ``halves``: the values of one value slot of a panel's 16 words, word ``2i + h`` at ``[i, h]``; ``zero``
    and ``scale`` float32 per row."""
    shifted = halves >> (4 * P)
    if ASM:
        pair = scaled_pair(tl.join(shifted, shifted), zero, scale, MAGIC16, dtype)
    else:
        low = ((shifted & 15).to(tl.float32) - zero[:, None]) * scale[:, None]
        high = (((shifted >> 16) & 15).to(tl.float32) - zero[:, None]) * scale[:, None]
        pair = tl.join(low, high)  # float32: the panel is rounded once it is whole (the interpreter's bf16 joins)
    return pair


@triton.jit
def _panel(words, zero, scale, MAGIC16: tl.constexpr, ASM: tl.constexpr, dtype: tl.constexpr,
           BLOCK_N: tl.constexpr):
    """``[BLOCK_N, 128]``: one panel's values ``(u - zero) * scale`` in ``dtype``, in natural K order (value slot
    ``j`` of word ``c`` at column ``16j + c``), from its ``[BLOCK_N, 16]`` words."""
    even, odd = tl.split(tl.reshape(words, [BLOCK_N, 8, 2]))
    low = _halves(even, odd, False, ASM)
    high = _halves(even, odd, True, ASM)
    # [BLOCK_N, 8 (word pair i), 2 (word 2i + h)] per slot j = 4 * half + 2 * a + b; each join adds a last dimension:
    # [BLOCK_N, i, h, b, a, half].
    slots = tl.join(tl.join(tl.join(_slot(low, zero, scale, 0, MAGIC16, ASM, dtype),
                                    _slot(low, zero, scale, 1, MAGIC16, ASM, dtype)),
                            tl.join(_slot(low, zero, scale, 2, MAGIC16, ASM, dtype),
                                    _slot(low, zero, scale, 3, MAGIC16, ASM, dtype))),
                    tl.join(tl.join(_slot(high, zero, scale, 0, MAGIC16, ASM, dtype),
                                    _slot(high, zero, scale, 1, MAGIC16, ASM, dtype)),
                            tl.join(_slot(high, zero, scale, 2, MAGIC16, ASM, dtype),
                                    _slot(high, zero, scale, 3, MAGIC16, ASM, dtype))))
    # -> [BLOCK_N, half, a, b, i, h]: column 64 half + 32 a + 16 b + 2 i + h.
    return tl.reshape(tl.permute(slots, (0, 5, 4, 3, 1, 2)), [BLOCK_N, 128]).to(dtype)


@triton.jit
def _scale_zero(s_ptr, z_ptr, offs_n, n_mask, g, stride_sn, HAS_ZEROS: tl.constexpr, EVEN_N: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Group ``g``'s float32 scale and zero (8 without zero points) of each weight row (``EVEN_N``: all rows are)."""
    if EVEN_N:
        s = tl.load(s_ptr + offs_n * stride_sn + g).to(tl.float32)
    else:
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0).to(tl.float32)
    if HAS_ZEROS:
        if EVEN_N:
            zero = tl.load(z_ptr + offs_n * stride_sn + g).to(tl.float32)
        else:
            zero = tl.load(z_ptr + offs_n * stride_sn + g, mask=n_mask, other=0).to(tl.float32)
    else:
        zero = tl.full([BLOCK_N], 8.0, tl.float32)
    return s, zero


@triton.jit
def _sum_or_store(acc, out, partials, split_stride, arrival, mask, pid_k, SPLIT_K: tl.constexpr,
                  SUM_CHUNK: tl.constexpr):
    """``kernels/packed_int.py``'s ``_store_or_reduce`` with the last program's sum of the partials in a loop,
    ``SUM_CHUNK`` of them loaded at once (as many as the registers the main loop took hold: one L2 round trip
    each chunk, not each partial)."""
    if SPLIT_K == 1:
        tl.store(out, acc.to(out.dtype.element_ty), mask=mask)
    else:
        tl.store(partials + pid_k * split_stride, acc, mask=mask)
        tl.debug_barrier()  # every thread's part is stored before the count releases it
        if tl.atomic_add(arrival, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for first in tl.range(0, SPLIT_K, SUM_CHUNK, loop_unroll_factor=1):
                for split in tl.static_range(SUM_CHUNK):
                    total += tl.load(partials + (first + split) * split_stride, mask=mask, other=0.0,
                                     cache_modifier=".cg")
            tl.atomic_xchg(arrival, 0, sem="relaxed")
            tl.store(out, total.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_pair(acc, out, own, other, arrival, mask, is_up):
    """``silu(gate) * up`` of a gate tile and its up tile, one of them ``acc``: each program stores its tile rounded
    (``own``), the later of the two loads the other's (``other``) and stores the product, rounded as the separate
    matmul and ``silu_mul`` kernels round (``kernels/fused.py``)."""
    y = acc.to(out.dtype.element_ty)
    tl.store(own, y, mask=mask)
    tl.debug_barrier()  # every thread's part is stored before the count releases it
    if tl.atomic_add(arrival, 1, sem="acq_rel") == 1:
        partner = tl.load(other, mask=mask, other=0.0, cache_modifier=".cg")
        gate = tl.where(is_up, partner, y).to(tl.float32)
        up = tl.where(is_up, y, partner).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out.dtype.element_ty).to(tl.float32)
        tl.atomic_xchg(arrival, 0, sem="relaxed")
        tl.store(out, (silu * up).to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])  # one compile for every batch size
def _natural_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, partials_ptr, arrivals_ptr, M, N, k_per_split,
                        stride_xm, stride_wn, stride_sn, stride_om, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                        SPLIT_K: tl.constexpr, SUM_CHUNK: tl.constexpr, MAGIC16: tl.constexpr, ASM: tl.constexpr,
                        EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
                        prefetch_ptr, prefetch_lines, first_prefetcher, PREFETCH: tl.constexpr,
                        PREFETCH_BLOCK: tl.constexpr, HEAD_LINES: tl.constexpr = 2,
                        SILU_MUL: tl.constexpr = False):
    # SILU_MUL: the weight is [gate | up] (2N rows), the first half of the programs take gate's row tiles and the
    # second half up's; out is silu(gate) * up, partials_ptr the matmul's [M, 2N] output.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if SILU_MUL:
        pairs = tl.num_programs(0) // 2
        is_up = pid_n >= pairs
        pair = pid_n - is_up.to(tl.int32) * pairs
        row0 = pair * BLOCK_N + is_up.to(tl.int32) * N  # the tile's first weight row
        offs_n = pair * BLOCK_N + tl.arange(0, BLOCK_N)
    else:
        row0 = pid_n * BLOCK_N
        offs_n = row0 + tl.arange(0, BLOCK_N)
    rows_w = row0 + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_tile = w_ptr + rows_w[:, None] * stride_wn + tl.arange(0, 16)[None, :]
    x_panel = x_ptr + offs_m[None, :] * stride_xm + tl.arange(0, 128)[:, None]  # [128, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = k_begin + k_per_split
    if PDL:  # launched with PDL (kernels/pdl.py): L2 fetches the first panels (two a line) while the kernel before
        # finishes
        _prefetch_tile_head(w_ptr, rows_w, n_mask, k_begin // 8, k_end // 8, stride_wn, 16 * HEAD_LINES)
    s_next, zero_next = _scale_zero(s_ptr, z_ptr, rows_w, n_mask, k_begin // GROUP, stride_sn, HAS_ZEROS, EVEN_N,
                                    BLOCK_N)
    wait_for_previous(PDL)  # the activations are the kernel before's output
    for k0 in range(k_begin, k_end, 128):
        # Whole panels (k_per_split is whole panels: said so, a row's 64 bytes copy 16 bytes at a time, not 8).
        panel = w_tile + tl.multiple_of(k0 // 8, 16)
        if EVEN_N:  # whole row tiles: unmasked (the predicates were 5% of the loop's instructions)
            words = tl.load(panel, eviction_policy="evict_first")
        else:
            words = tl.load(panel, mask=n_mask[:, None], other=0, eviction_policy="evict_first")
        s, zero = s_next, zero_next
        # The next step's group (the last step reloads its own: an L2 hit instead of a predicate), a step ahead.
        s_next, zero_next = _scale_zero(s_ptr, z_ptr, rows_w, n_mask, tl.minimum(k0 + 128, k_end - 128) // GROUP,
                                        stride_sn, HAS_ZEROS, EVEN_N, BLOCK_N)
        x = tl.load(x_panel + k0, mask=m_mask[None, :], other=0)
        acc = tl.dot(_panel(words, zero, s, MAGIC16, ASM, x.dtype, BLOCK_N), x, acc)
    allow_next(PDL)  # after the weight loop, as the 16-bit tiles (kernels/small_batch.py)
    tile = offs_m[None, :] * stride_om + offs_n[:, None]
    mask = n_mask[:, None] & m_mask[None, :]
    arrival = arrivals_ptr + pid_m * tl.num_programs(0) + pid_n
    if SILU_MUL:  # one counter per pair of tiles
        matmul = partials_ptr + offs_m[None, :] * (2 * N) + offs_n[:, None]
        _silu_mul_pair(acc, out_ptr + tile, matmul + is_up.to(tl.int32) * N, matmul + (1 - is_up.to(tl.int32)) * N,
                       arrivals_ptr + pid_m * pairs + pair, mask, is_up)
    else:
        _sum_or_store(acc, out_ptr + tile, partials_ptr + offs_m[None, :] * N + offs_n[:, None], M * N, arrival,
                      mask, pid_k, SPLIT_K, SUM_CHUNK)
    if PREFETCH:  # the next weight's head into L2 as the last programs finish (kernels/packed_int.py's GEMV too)
        _prefetch_share(prefetch_ptr, prefetch_lines, first_prefetcher, PREFETCH_BLOCK)
