"""One Triton kernel for the greedy pick: each row's argmax over the vocabulary (imported only on a CUDA device, or
under ``TRITON_INTERPRET=1`` in tests).

``torch.argmax`` over a 128k vocabulary runs as one slow reduction, and the sampler's two-pass form
(``argmax_last_dim``'s CPU path) as five launches; both sit on the path of every synchronous decode step. Here the
programs of a row each stream a slice of it (one slice per ``4 * BLOCK`` columns, at most ``MAX_SPLITS``), each lane
keeping its first maximum; the last of a row's programs to finish picks among the slices' picks (a per-row counter,
reset by that program, so one launch). The pick is ``torch.argmax``'s: the lowest index among equal maxima, and
the first NaN if there is one. One program per row streamed a 128k row in 18 us on an H100 (28 us for a verify
step's five rows), on the path between a step's logits and its results reaching the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096
MAX_SPLITS = 16


@triton.jit
def _first_best(best, best_at, none_past):
    """(value, index) of the lanes' pick: the lowest index among NaN lanes if any, else among the maxima."""
    nan_lane = best != best
    if tl.max(nan_lane.to(tl.int32), 0) > 0:
        return float("nan"), tl.min(tl.where(nan_lane, best_at, none_past), 0)
    top = tl.max(best, 0)
    return top, tl.min(tl.where(best == top, best_at, none_past), 0)


@triton.jit
def _argmax_kernel(X, Out, Part_value, Part_at, Arrivals, stride_row, vocab, split_len,
                   BLOCK: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    first = split * split_len
    end = tl.minimum(first + split_len, vocab)
    for start in range(first, end, BLOCK):
        at = start + offs
        x = tl.load(X + row * stride_row + at, mask=at < end, other=float("-inf")).to(tl.float32)
        # A lane keeps its first maximum; a NaN beats every number and the first NaN stays.
        take = (x > best) | ((x != x) & (best == best))
        best = tl.where(take, x, best)
        best_at = tl.where(take, at, best_at)
    # A slice of -inf alone picks index 0, which is torch's pick too when the whole row is -inf.
    value, pick = _first_best(best, best_at, vocab)  # vocab: larger than every index
    if SPLITS == 1:
        tl.store(Out + row, pick.to(tl.int64))
    else:
        tl.store(Part_value + row * SPLITS + split, value)
        tl.store(Part_at + row * SPLITS + split, pick)
        tl.debug_barrier()  # the slice's pick is stored before the count releases it
        # The release/acquire of the count makes the other slices' picks visible to the last one.
        if tl.atomic_add(Arrivals + row, 1, sem="acq_rel") == SPLITS - 1:
            slices = row * SPLITS + tl.arange(0, SPLITS)
            values = tl.load(Part_value + slices, cache_modifier=".cg")
            picks = tl.load(Part_at + slices, cache_modifier=".cg")
            # Slices in column order, each pick its slice's lowest: the same rule gives the row's.
            _, row_pick = _first_best(values, picks, vocab)
            tl.atomic_xchg(Arrivals + row, 0, sem="relaxed")
            tl.store(Out + row, row_pick.to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` (int64) of a 16- or 32-bit float ``[rows, vocab]`` tensor with unit stride along
    the vocabulary (values are compared in float32)."""
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if not rows:
        return out
    splits = min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(vocab, 4 * _BLOCK)))
    split_len = triton.cdiv(triton.cdiv(vocab, splits), _BLOCK) * _BLOCK
    part_value = torch.empty((rows, splits), dtype=torch.float32, device=x.device) if splits > 1 else out
    part_at = torch.empty((rows, splits), dtype=torch.int32, device=x.device) if splits > 1 else out
    _argmax_kernel[(rows, splits)](x, out, part_value, part_at, _arrivals(x.device, rows), x.stride(0), vocab,
                                   split_len, BLOCK=_BLOCK, SPLITS=splits, num_warps=8)
    return out


# Zeroed int32 counters per device, one per row, each left zero by its row's last program. Every set ever made stays
# referenced: a CUDA graph that captured an argmax (a drafter's) keeps pointing at the set it was captured with.
_arrival_sets: dict[torch.device, list[torch.Tensor]] = {}


def _arrivals(device: torch.device, rows: int) -> torch.Tensor:
    sets = _arrival_sets.setdefault(device, [])
    if not sets or sets[-1].numel() < rows:
        sets.append(torch.zeros(max(rows, 256, 2 * sets[-1].numel() if sets else 0), dtype=torch.int32,
                                device=device))
    return sets[-1]
