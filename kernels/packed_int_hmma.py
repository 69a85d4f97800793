"""The one-token W4A16 GEMV's loop on the tensor cores (``IntTiles.hmma``, a sweep trial; bf16 activations, groups
of whole panels): the lean loop's tiles (``kernels/packed_int_lean.py``), each thread four words of one panel of
each of its rows, but the products and their sums are ``mma.sync.m16n8k16`` instructions in inline PTX, and each
pair of 4-bit values costs one lop3 (and one shift): about half the instructions a value of the lean loop.

Each word's values ``p`` and ``p + 4`` become one register of two bf16 ``128 + u`` (``(w >> 4p) & 0x000F000F |
0x43004300``), and the matching activations one register of two bf16. One MMA takes, per thread, two such
registers of two rows (its ``A`` rows ``g`` and ``g + 8``, ``g`` the lane's group of four) and the two activation
registers (its ``B`` column ``g``): the output ``C[g][g]`` sums the four lanes of group ``g``'s products of the
first row, ``C[g + 8][g]`` of the second, and the other outputs are never read. Each step (one panel per lane, so
one group) keeps its own sums; an MMA of ones by the same activations gives each lane group's activation sum,
which takes the widening's 128 and the zero away as the group's scale is applied. At the end each lane keeps its
diagonal outputs (lane ``4g + t`` holds ``C[g][2t]``, ``C[g][2t + 1]``: ``t = g // 2``) and the lanes are summed.
The CPU interpreter cannot run the PTX; only GPU tests check this loop (``tests/gpu/test_packed_int_magic_gpu.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from treadle.kernels.pdl import wait_for_previous

_MMA = tl.constexpr("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                    "{$8, $9}, {$10, $11, $12, $13};")


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """One ``m16n8k16`` bf16 MMA per element (all lanes run the same element at once): ``A`` registers ``a0`` (row
    ``g``, K ``2t, 2t + 1``), ``a1`` (row ``g + 8``, same K), ``a2`` / ``a3`` (K ``2t + 8, 2t + 9``); ``B``
    registers ``b0`` (K ``2t, 2t + 1``), ``b1`` (K ``2t + 8, 2t + 9``), column ``g``; ``c`` accumulated."""
    b0 = tl.broadcast_to(b0, a0.shape)
    b1 = tl.broadcast_to(b1, a0.shape)
    return tl.inline_asm_elementwise(_MMA, "=f,=f,=f,=f,r,r,r,r,r,r,0,1,2,3",
                                     [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
                                     dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _pair(word, P: tl.constexpr):
    """Values ``P`` and ``P + 4`` of each uint32 word as two bf16 ``128 + u`` in one register."""
    return ((word >> (4 * P)) & 0x000F000F) | 0x43004300


@triton.jit
def _four(tensor):
    """The four words (last dimension) of ``[.., 4]`` as four tensors."""
    t01, t23 = tl.split(tl.reshape(tensor, tensor.shape[:-1] + [2, 2]))
    t0, t1 = tl.split(t01)
    t2, t3 = tl.split(t23)
    return t0, t1, t2, t3


@triton.jit
def _word_sums(even, odd, xp0, xp1, xp2, xp3, ones, d0, d1, d2, d3, x0, x1, x2, x3):
    """Accumulates one word's eight values of the even and odd rows (``[R / 2, QUADS]`` uint32) times their
    activations (``xp<p>``: the bf16 pair of values ``p`` and ``p + 4``' activations, ``[QUADS]``), and (an MMA of
    ones) the activations' sums: pairs 0 and 1 in one MMA, 2 and 3 in another."""
    d0, d1, d2, d3 = _mma(_pair(even, 0), _pair(odd, 0), _pair(even, 1), _pair(odd, 1), xp0[None, :], xp1[None, :],
                          d0, d1, d2, d3)
    x0, x1, x2, x3 = _mma(ones, ones, ones, ones, xp0, xp1, x0, x1, x2, x3)
    d0, d1, d2, d3 = _mma(_pair(even, 2), _pair(odd, 2), _pair(even, 3), _pair(odd, 3), xp2[None, :], xp3[None, :],
                          d0, d1, d2, d3)
    x0, x1, x2, x3 = _mma(ones, ones, ones, ones, xp2, xp3, x0, x1, x2, x3)
    return d0, d1, d2, d3, x0, x1, x2, x3


@triton.jit
def _x_pairs(x_ptr, k0, x_offs, P: tl.constexpr):
    """``[QUADS, 4]`` uint32: the bf16 activations of value slots ``P`` (low half) and ``P + 4`` (high half) of each
    word."""
    low = tl.load(x_ptr + tl.multiple_of(k0, 16) + x_offs + 16 * P).to(tl.uint16, bitcast=True).to(tl.uint32)
    high = tl.load(x_ptr + tl.multiple_of(k0, 16) + x_offs + 16 * (P + 4)).to(tl.uint16, bitcast=True).to(tl.uint32)
    return low | (high << 16)


@triton.jit
def _hmma_gemv_rows(x_ptr, w_ptr, s_ptr, z_ptr, offs_n, n_mask, k_begin, k_per_split, stride_wn, stride_sn,
                    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                    PDL: tl.constexpr):
    """float32 sums of the bf16 activation row with the 4-bit weight rows ``offs_n`` (``BLOCK_N`` even) over one K
    range, groups of whole panels (module docstring)."""
    QUADS: tl.constexpr = BLOCK_W // 4
    HALF: tl.constexpr = BLOCK_N // 2
    STEP: tl.constexpr = BLOCK_W * 8
    quad = tl.arange(0, QUADS)
    word_offs = 4 * quad[:, None] + tl.arange(0, 4)[None, :]
    x_offs = 128 * (quad // 4)[:, None] + 4 * (quad % 4)[:, None] + tl.arange(0, 4)[None, :]
    panel_k = 128 * (quad // 4)
    rows = tl.where(n_mask, offs_n, tl.min(offs_n, axis=0))
    # Rows as (pair, even/odd): [HALF, 2, QUADS, 4] words, permuted so each pair's two rows split apart.
    w_rows = w_ptr + tl.reshape(rows, [HALF, 2])[:, :, None, None] * stride_wn + word_offs[None, None, :, :]
    s_rows = tl.reshape(rows, [HALF, 2])[:, :, None] * stride_sn
    k_end = k_begin + k_per_split
    words = tl.load(w_rows + tl.multiple_of((k_end - k_per_split) // 8, 16), eviction_policy="evict_first")
    wait_for_previous(PDL)
    ones = tl.full([QUADS], 0x3F803F80, tl.uint32)  # two bf16 1.0
    acc0 = tl.zeros([HALF, QUADS], dtype=tl.float32)
    acc1 = tl.zeros([HALF, QUADS], dtype=tl.float32)
    acc2 = tl.zeros([HALF, QUADS], dtype=tl.float32)
    acc3 = tl.zeros([HALF, QUADS], dtype=tl.float32)
    for k0 in tl.range(k_begin, k_end, STEP, loop_unroll_factor=2):
        upcoming = tl.load(w_rows + tl.multiple_of(tl.minimum(k0 + STEP, k_end - STEP) // 8, 16),
                           eviction_policy="evict_first")
        even, odd = tl.split(tl.permute(words.to(tl.uint32, bitcast=True), (0, 2, 3, 1)))
        e0, e1, e2, e3 = _four(even)
        o0, o1, o2, o3 = _four(odd)
        p00, p01, p02, p03 = _four(_x_pairs(x_ptr, k0, x_offs, 0))  # p<P><word>
        p10, p11, p12, p13 = _four(_x_pairs(x_ptr, k0, x_offs, 1))
        p20, p21, p22, p23 = _four(_x_pairs(x_ptr, k0, x_offs, 2))
        p30, p31, p32, p33 = _four(_x_pairs(x_ptr, k0, x_offs, 3))
        zero = tl.zeros([HALF, QUADS], dtype=tl.float32)
        zero_x = tl.zeros([QUADS], dtype=tl.float32)
        d0, d1, d2, d3, x0, x1, x2, x3 = _word_sums(e0, o0, p00, p10, p20, p30, ones, zero, zero, zero, zero, zero_x,
                                                    zero_x, zero_x, zero_x)
        d0, d1, d2, d3, x0, x1, x2, x3 = _word_sums(e1, o1, p01, p11, p21, p31, ones, d0, d1, d2, d3, x0, x1, x2, x3)
        d0, d1, d2, d3, x0, x1, x2, x3 = _word_sums(e2, o2, p02, p12, p22, p32, ones, d0, d1, d2, d3, x0, x1, x2, x3)
        d0, d1, d2, d3, x0, x1, x2, x3 = _word_sums(e3, o3, p03, p13, p23, p33, ones, d0, d1, d2, d3, x0, x1, x2, x3)
        index = s_rows + ((k0 + panel_k) // GROUP)[None, None, :]
        s_even, s_odd = tl.split(tl.permute(tl.load(s_ptr + index).to(tl.float32), (0, 2, 1)))
        if HAS_ZEROS:
            z_even, z_odd = tl.split(tl.permute(tl.load(z_ptr + index).to(tl.float32) + 128.0, (0, 2, 1)))
        else:
            z_even = 136.0
            z_odd = 136.0
        acc0 += s_even * (d0 - z_even * x0[None, :])
        acc1 += s_even * (d1 - z_even * x1[None, :])
        acc2 += s_odd * (d2 - z_odd * x2[None, :])
        acc3 += s_odd * (d3 - z_odd * x3[None, :])
        words = upcoming
    lane = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [quad], dtype=tl.int32, is_pure=True, pack=1)
    group = lane >> 2
    diagonal = ((lane & 3) == (group >> 1))[None, :]
    first = ((group & 1) == 0)[None, :]
    even_rows = tl.sum(tl.where(diagonal, tl.where(first, acc0, acc1), 0.0), axis=1)
    odd_rows = tl.sum(tl.where(diagonal, tl.where(first, acc2, acc3), 0.0), axis=1)
    return tl.reshape(tl.join(even_rows, odd_rows), [BLOCK_N])
