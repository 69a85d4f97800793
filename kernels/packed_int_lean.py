"""The one-token W4A16 GEMV's loop with fewer instructions per weight byte (``IntTiles.lean``, run by
``kernels/packed_int.py``'s ``_int_gemv_kernel`` and its fused epilogues): at one token the integer GEMV is bound by
the instructions its SMs issue per packed byte, not by memory (``python -m treadle.bench.int_sass`` counts them).

Each thread holds the same four consecutive words (16 bytes, one panel's) of each of its program's rows, and the
activations of those words' columns are loaded straight into that layout (no shuffles between the lanes). A value
is widened as a float32 subnormal (one and; ``kernels/packed_int.py``'s ``_subnormal_times_x``) and multiplied by
its activation, pre-scaled by the power of two, in one FMA; the sums of a thread's four words of a row are added
up once per group, and only then meet the group's scale and the zero (the symmetric 8, or the zero point) through
the thread's activation sum, which is computed once for all its rows. Scales and zeros load once per row and group.
"""

from __future__ import annotations

import triton
import triton.language as tl

from treadle.kernels.packed_int_hmma import _hmma_gemv_rows
from treadle.kernels.pdl import wait_for_previous


def lean_splits(n: int, words: int, block_n: int, sm_count: int) -> list[int]:
    """The lean GEMV's split-K counts for ``n`` rows of ``words`` words, two panels (128 words) a step: the fewest K
    ranges of whole steps (any divisor of the steps, up to 16: down_proj's 14 steps split 7 ways) that give 12
    programs per SM, and the next fewer."""
    tiles, steps = triton.cdiv(n, block_n), words // 128
    splits = [d for d in range(1, min(steps, 16) + 1) if steps % d == 0]
    best = next((i for i, d in enumerate(splits) if tiles * d >= 12 * sm_count), len(splits) - 1)
    return list(dict.fromkeys([splits[best], splits[max(best - 1, 0)]]))


@triton.jit
def _slot(word, word_high, J: tl.constexpr):
    """Value slot ``J`` of each uint32 word as a float32 subnormal, one and: ``u * 2**(4J - 149)`` for slots 0-4
    (slot 4 at bits 16-19 is still below the exponent), ``u * 2**(4J - 165)`` for slots 5-7 (from the word shifted
    by 16)."""
    if J <= 4:
        value = (word & (15 << (4 * J))).to(tl.float32, bitcast=True)
    else:
        value = (word_high & (15 << (4 * (J - 4)))).to(tl.float32, bitcast=True)
    return value


@triton.jit
def _pre_scaled(x, J: tl.constexpr):
    """float32 ``x * 2**E`` (``E = 89 - 4J``, slots 5-7 ``105 - 4J``: each product with :func:`_slot`'s value is
    then ``u * x * 2**-60``). bf16 activations take the power of two by one integer add to their exponent: exact for
    normal ``|x| < 2**38`` (a larger one overflows the float multiplication too), and a zero becomes ``2**(E -
    127)``, whose product with any value is below half the smallest subnormal and rounds to zero."""
    E: tl.constexpr = 89 - 4 * J if J <= 4 else 105 - 4 * J
    if x.dtype == tl.bfloat16:
        bits = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16) + (E << 23)
        scaled = bits.to(tl.float32, bitcast=True)
    else:
        scaled = x.to(tl.float32) * (1.0 * (1 << E))
    return scaled


@triton.jit
def _unscale(J: tl.constexpr):
    """``2**-E``: :func:`_pre_scaled`'s power of two taken back off."""
    E: tl.constexpr = 89 - 4 * J if J <= 4 else 105 - 4 * J
    return 1.0 / (1 << E)


@triton.jit
def _lean_gemv_rows(x_ptr, w_ptr, s_ptr, z_ptr, offs_n, n_mask, k_begin, k_per_split, stride_wn, stride_sn,
                    GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                    PDL: tl.constexpr, HMMA: tl.constexpr = False):
    """float32 sums of the activation row with the 4-bit weight rows ``offs_n`` over one K range (module docstring).
    The words of a step are ``[BLOCK_N, BLOCK_W // 4, 4]``: row, thread (four words of one panel), word; each row's
    four words are split apart so their products chain on one accumulator per row and thread. ``HMMA``: the same
    tiles on the tensor cores (``kernels/packed_int_hmma.py``)."""
    if HMMA:
        return _hmma_gemv_rows(x_ptr, w_ptr, s_ptr, z_ptr, offs_n, n_mask, k_begin, k_per_split, stride_wn,
                               stride_sn, GROUP, HAS_ZEROS, BLOCK_N, BLOCK_W, PDL)
    QUADS: tl.constexpr = BLOCK_W // 4
    STEP: tl.constexpr = BLOCK_W * 8
    JG: tl.constexpr = GROUP // 16 if GROUP // 16 < 8 else 8  # value slots per group fold
    quad = tl.arange(0, QUADS)
    # Word (quad, c) of a step: panel quad // 4, word 4 * (quad % 4) + c of it; its column of slot j in the step's
    # K range is 128 * (quad // 4) + 16 * j + 4 * (quad % 4) + c.
    word_offs = 4 * quad[:, None] + tl.arange(0, 4)[None, :]
    x_offs = 128 * (quad // 4)[:, None] + 4 * (quad % 4)[:, None] + tl.arange(0, 4)[None, :]
    panel_k = 128 * (quad // 4)  # each thread's panel, as a K offset within the step
    # Rows past N read the tile's first row instead (their sums are never stored): the loads need no mask, so no
    # instructions clear their registers first.
    rows = tl.where(n_mask, offs_n, tl.min(offs_n, axis=0))
    w_rows = w_ptr + rows[:, None, None] * stride_wn + word_offs[None, :, :]
    s_rows = rows[:, None] * stride_sn
    k_end = k_begin + k_per_split
    words = tl.load(w_rows + tl.multiple_of((k_end - k_per_split) // 8, 16), eviction_policy="evict_first")
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_N, QUADS], dtype=tl.float32)
    for k0 in tl.range(k_begin, k_end, STEP, loop_unroll_factor=2):
        # The next step's words (the last step reloads its own: an L2 hit instead of a predicate).
        upcoming = tl.load(w_rows + tl.multiple_of(tl.minimum(k0 + STEP, k_end - STEP) // 8, 16),
                           eviction_policy="evict_first")
        w01, w23 = tl.split(tl.reshape(words.to(tl.uint32, bitcast=True), [BLOCK_N, QUADS, 2, 2]))
        w0, w1 = tl.split(w01)
        w2, w3 = tl.split(w23)
        h0, h1, h2, h3 = w0 >> 16, w1 >> 16, w2 >> 16, w3 >> 16
        for j in tl.static_range(8):
            x = _pre_scaled(tl.load(x_ptr + tl.multiple_of(k0, 16) + x_offs + 16 * j), j)
            x01, x23 = tl.split(tl.reshape(x, [QUADS, 2, 2]))
            x0, x1 = tl.split(x01)
            x2, x3 = tl.split(x23)
            if j % JG == 0:  # a group's first slot starts its sums (no zeroed registers to add to)
                part = _slot(w0, h0, j) * x0[None, :]
                x_sum = ((x0 + x1) + (x2 + x3)) * _unscale(j)  # the activations' plain sum
            else:
                part += _slot(w0, h0, j) * x0[None, :]
                x_sum += ((x0 + x1) + (x2 + x3)) * _unscale(j)
            part += _slot(w1, h1, j) * x1[None, :]
            part += _slot(w2, h2, j) * x2[None, :]
            part += _slot(w3, h3, j) * x3[None, :]
            if (j + 1) % JG == 0:
                index = s_rows + ((k0 + panel_k + 16 * (j + 1 - JG)) // GROUP)[None, :]
                s = tl.load(s_ptr + index).to(tl.float32)
                if HAS_ZEROS:
                    zero = tl.load(z_ptr + index).to(tl.float32)
                else:
                    zero = 8.0
                acc += s * (part - zero * (x_sum * 8.673617379884035e-19)[None, :])  # part's units, 2**-60
        words = upcoming
    return tl.sum(acc, axis=1) * 1152921504606846976.0  # 2**60
