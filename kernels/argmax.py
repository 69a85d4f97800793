"""Triton kernels for the greedy pick: each row's argmax over the vocabulary (imported only on a CUDA device, or
under ``TRITON_INTERPRET=1`` in tests).

``torch.argmax`` over a 128k vocabulary runs as one slow reduction, and the sampler's two-pass form
(``argmax_last_dim``'s CPU path) as five launches; both sit on the path of every synchronous decode step. Here one
launch does it: each program takes one block of a row's vocabulary and stores its block's pick (the lowest index
among equal maxima, or its first NaN) and value; the last of a row's programs to arrive (counted on a per-row
counter, which it resets) picks among the blocks in their order, so the pick is ``torch.argmax``'s. One program
streaming a whole 128k row took ~17 us on an H200 at bs=1 (one SM's share of the bandwidth); 32 programs a row
read it in parallel in ~3 us (docs/benchmarks.md). Where no counters can be set aside (the first call inside a CUDA graph capture) one program a
row streams the row instead (``_argmax_kernel``), with the same pick.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096
_ROW_COUNTERS = 1 << 16  # rows a launch of the split form may have (more: the one-program form)
_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _argmax_kernel(X, Out, stride_row, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        at = start + offs
        x = tl.load(X + row * stride_row + at, mask=at < vocab, other=float("-inf")).to(tl.float32)
        # A lane keeps its first maximum; a NaN beats every number and the first NaN stays.
        take = (x > best) | ((x != x) & (best == best))
        best = tl.where(take, x, best)
        best_at = tl.where(take, at, best_at)
    tl.store(Out + row, _pick(best, best_at, vocab).to(tl.int64))


@triton.jit
def _pick(values, at, none_past):
    """The first NaN's position among ``values`` if there is one, else the lowest position of their maximum."""
    nan_lane = values != values
    any_nan = tl.max(nan_lane.to(tl.int32), 0) > 0
    wanted = tl.where(any_nan, nan_lane, values == tl.max(values, 0))
    return tl.min(tl.where(wanted, at, none_past), 0)


@triton.jit
def _argmax_blocks_kernel(X, Out, Block_value, Block_at, Counters, stride_row, vocab, BLOCK: tl.constexpr,
                          BLOCKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    at = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_row + at, mask=at < vocab, other=float("-inf")).to(tl.float32)
    pick = _pick(x, at, vocab)  # a position of this block: masked lanes come after every real one
    value = tl.sum(tl.where(at == pick, x, 0.0), 0)  # the pick's value, NaN included (a max would skip a NaN)
    tl.store(Block_value + row * BLOCKS + block, value)
    tl.store(Block_at + row * BLOCKS + block, pick)
    tl.debug_barrier()
    if tl.atomic_add(Counters + row, 1, sem="acq_rel") == tl.num_programs(1) - 1:
        blocks = tl.arange(0, BLOCKS)
        real = blocks < tl.num_programs(1)
        # The other programs' stores, in L2. Positions increase with the block, so the lowest position among the
        # blocks' picks is the row's.
        values = tl.load(Block_value + row * BLOCKS + blocks, mask=real, other=float("-inf"), cache_modifier=".cg")
        picks = tl.load(Block_at + row * BLOCKS + blocks, mask=real, other=vocab, cache_modifier=".cg")
        tl.store(Out + row, _pick(values, picks, vocab).to(tl.int64))
        tl.atomic_xchg(Counters + row, 0, sem="relaxed")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` (int64) of a 16- or 32-bit float ``[rows, vocab]`` tensor with unit stride along
    the vocabulary (values are compared in float32)."""
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if not rows:
        return out
    counters = _row_counters(x.device)
    blocks = triton.cdiv(vocab, _BLOCK)
    if counters is None or rows > counters.numel() or blocks == 1:
        _argmax_kernel[(rows,)](x, out, x.stride(0), vocab, BLOCK=_BLOCK, num_warps=8)
        return out
    padded = triton.next_power_of_2(blocks)
    block_value = torch.empty(rows, padded, dtype=torch.float32, device=x.device)
    block_at = torch.empty(rows, padded, dtype=torch.int32, device=x.device)
    _argmax_blocks_kernel[(rows, blocks)](x, out, block_value, block_at, counters, x.stride(0), vocab,
                                          BLOCK=_BLOCK, BLOCKS=padded, num_warps=8)
    return out


def _row_counters(device: torch.device) -> torch.Tensor | None:
    """Zeroed int32 counters, one per row, shared by every launch on the device (they run one after another on
    one stream; each row's last program resets its counter). None while a CUDA graph is being captured and none
    exist yet: a tensor made inside a capture belongs to that graph's memory."""
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = _counters[device] = torch.zeros(_ROW_COUNTERS, dtype=torch.int32, device=device)
    return counters
