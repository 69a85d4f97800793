"""Triton kernels of the peer-to-peer all-reduce: each rank pushes its tensor into the other ranks' buffers
(memory mapped into every rank, see ``core/distributed/custom_all_reduce.py``), raises a flag there, waits for
the other ranks' flags in its own memory and sums.

Buffer of one rank (the same layout on every rank, one allocation):

- flags, int64 ``[2 phases][world][programs]``: ``flags[phase][src][pid]`` is the last call number that program
  ``pid`` of rank ``src`` finished pushing in that phase;
- slots, ``[2 halves][world][slot_elems]`` of the tensor's dtype: ``slots[half][src]`` receives rank ``src``'s data.

The protocol. Every rank launches the same kernels in the same order with the same grid, so program ``pid`` of
every rank counts the same call number ``epoch`` (``epochs[pid]``, local, bumped by the program itself: graph
replays keep counting). A program only ever waits for the same-numbered program of its peers (in the fused kernel,
for the programs of its row's group), and only for data that those programs wrote; the programs a kernel waits
between must all be resident at once, which they are (32 programs; a kernel launched early through PDL takes SMs
only once every program of this one has started). Call ``epoch`` writes half ``epoch % 2``; a peer still reading that half would be two
calls behind, which it cannot be: this rank's previous call ended only after every peer had started it, so every
peer had finished the call before (stream order). Hence one flag exchange per phase and no reset; a flag is
compared with ``>=`` because a fast peer may already have raised the next call's number. A program with no
elements (a one-row decode batch is one program's) counts the call but skips the exchange: program 0 always has
elements, and its exchange alone orders whole calls as above.

A program raises its flags in all peers at once (one lane each) and polls all of its own at once: peer after peer,
each system-scope release waits for the flag before it to land, one NVLink round trip per peer.

Sums run in rank order in float32 on every rank, so every rank gets bitwise the same result, run after run.

A wait that spins ``max_spins`` times gives up and counts an error in ``errors`` (the result is then garbage;
callers check ``errors`` in tests, a hang would be worse).

Launched with PDL on Hopper (``PDL``, kernels/pdl.py): a program loads what no kernel still running writes (the
norm's weight) before it waits for the kernel before, and (``GO_AHEAD``) lets the kernel after it start right
after that wait, so that the next matmul's programs load their first weight blocks while this kernel's flags
cross NVLink: the exchange needs a few SMs and almost no bandwidth, the matmul after it all of both.
"""

from __future__ import annotations

import triton
import triton.language as tl

from treadle.kernels.fused import rmsnorm_row, rounded_add
from treadle.kernels.pdl import allow_next, wait_for_previous

# The most ranks the kernels serve (core/distributed/custom_all_reduce.py's SUPPORTED_WORLD_SIZES).
MAX_WORLD: tl.constexpr = tl.constexpr(8)


@triton.jit
def _exchange_flags(bases, phase, pid, epoch, errors, RANK: tl.constexpr, WORLD: tl.constexpr,
                    PROGRAMS: tl.constexpr, MAX_SPINS: tl.constexpr, first=None, COUNT: tl.constexpr = 1):
    """Raise this program's flag in every peer's buffer, then wait until every peer's programs ``first`` ..
    ``first + COUNT - 1`` (default: the same-numbered one) have raised theirs here. One lane per flag: the flags
    cross NVLink together (one after another, each system-scope release waits for the atomic before it: one NVLink
    round trip per peer)."""
    if first is None:
        first = pid
    # Every lane's stores before the flag; the flag after them (release, system scope).
    tl.debug_barrier()
    peers = tl.arange(0, MAX_WORLD)
    others = (peers < WORLD) & (peers != RANK)
    peer_bases = tl.load(bases + peers, mask=others, other=0)
    raised = peer_bases.to(tl.pointer_type(tl.int64)) + (phase * WORLD + RANK) * PROGRAMS + pid
    tl.atomic_xchg(raised, tl.zeros_like(peers).to(tl.int64) + epoch, mask=others, sem="release", scope="sys")
    own = tl.load(bases + RANK).to(tl.pointer_type(tl.int64))
    members = first + tl.arange(0, COUNT)
    awaited = own + (phase * WORLD + peers[:, None]) * PROGRAMS + members[None, :]
    wanted = tl.broadcast_to(others[:, None], (MAX_WORLD, COUNT))
    seen = tl.atomic_add(awaited, 0, mask=wanted, sem="acquire", scope="sys")
    lowest = tl.min(tl.min(tl.where(wanted, seen, epoch), axis=1), axis=0)
    spins = 0
    while (lowest < epoch) & (spins < MAX_SPINS):
        seen = tl.atomic_add(awaited, 0, mask=wanted, sem="acquire", scope="sys")
        lowest = tl.min(tl.min(tl.where(wanted, seen, epoch), axis=1), axis=0)
        spins += 1
    if lowest < epoch:
        tl.atomic_add(errors, 1)
    tl.debug_barrier()


@triton.jit
def _slot(base, half, src, like, FLAG_BYTES: tl.constexpr, WORLD: tl.constexpr, SLOT_ELEMS: tl.constexpr):
    """Rank ``base``'s slot ``[half][src]``, a pointer of ``like``'s type."""
    # Slots start 256-byte aligned and hold a multiple of 16 bytes: tell the compiler, so that it vectorizes.
    return tl.multiple_of((base + FLAG_BYTES).to(like.dtype) + (half * WORLD + src) * SLOT_ELEMS, 16)


@triton.jit
def _sum_in_rank_order(x, own, half, at, mask, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                       FLAG_BYTES: tl.constexpr, SLOT_ELEMS: tl.constexpr):
    """float32 sum over the ranks of elements ``at``: this rank's from ``x``, the others' from their slots here."""
    acc = tl.zeros([BLOCK], tl.float32)
    for p in tl.static_range(WORLD):
        if p == RANK:
            part = tl.load(x + at, mask=mask, other=0.0)
        else:
            part = tl.load(_slot(own, half, p, x, FLAG_BYTES, WORLD, SLOT_ELEMS) + at, mask=mask, other=0.0)
        acc += part.to(tl.float32)
    return acc


@triton.jit
def _next_epoch(epochs, pid, PDL: tl.constexpr, GO_AHEAD: tl.constexpr):
    """This program's call number, counted once the kernel before has completed (a kernel of the same all-reduce
    could be the one before); the next kernel may start from then on (``GO_AHEAD``)."""
    wait_for_previous(PDL)
    if GO_AHEAD:
        allow_next(PDL)
    epoch = tl.load(epochs + pid) + 1
    tl.store(epochs + pid, epoch)
    return epoch


@triton.jit
def one_shot_all_reduce_kernel(x, n, bases, epochs, errors, RANK: tl.constexpr, WORLD: tl.constexpr,
                               PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, FLAG_BYTES: tl.constexpr,
                               SLOT_ELEMS: tl.constexpr, MAX_SPINS: tl.constexpr, PDL: tl.constexpr = False,
                               GO_AHEAD: tl.constexpr = False):
    """``x`` (``n`` elements) replaced by its sum over the ranks: push ``x`` to every peer, one flag exchange,
    sum the ranks' copies locally."""
    pid = tl.program_id(0)
    epoch = _next_epoch(epochs, pid, PDL, GO_AHEAD)
    half = epoch % 2
    for start in range(pid * BLOCK, n, PROGRAMS * BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
        mask = offs < n
        mine = tl.load(x + offs, mask=mask)
        for p in tl.static_range(WORLD):
            if p != RANK:
                peer_slot = _slot(tl.load(bases + p), half, RANK, x, FLAG_BYTES, WORLD, SLOT_ELEMS)
                tl.store(peer_slot + offs, mine, mask=mask)
    if pid * BLOCK < n:  # a program without elements has nothing to exchange (see the module's protocol)
        _exchange_flags(bases, 0, pid, epoch, errors, RANK, WORLD, PROGRAMS, MAX_SPINS)
    own = tl.load(bases + RANK)
    for start in range(pid * BLOCK, n, PROGRAMS * BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
        mask = offs < n
        acc = _sum_in_rank_order(x, own, half, offs, mask, RANK, WORLD, BLOCK, FLAG_BYTES, SLOT_ELEMS)
        tl.store(x + offs, acc.to(x.dtype.element_ty), mask=mask)


@triton.jit
def two_shot_all_reduce_kernel(x, n, bases, epochs, errors, RANK: tl.constexpr, WORLD: tl.constexpr,
                               PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, FLAG_BYTES: tl.constexpr,
                               SLOT_ELEMS: tl.constexpr, MAX_SPINS: tl.constexpr, PDL: tl.constexpr = False,
                               GO_AHEAD: tl.constexpr = False):
    """``x`` replaced by its sum over the ranks in two phases: rank r owns chunk r of ``WORLD`` chunks; each rank
    pushes chunk p to rank p, which sums it (reduce-scatter) and pushes the sum back into every peer's slot at
    the chunk's own place (all-gather)."""
    pid = tl.program_id(0)
    epoch = _next_epoch(epochs, pid, PDL, GO_AHEAD)
    half = epoch % 2
    chunk = tl.cdiv(tl.cdiv(n, WORLD), 16) * 16  # chunks start 16 elements aligned
    for start in range(pid * BLOCK, chunk, PROGRAMS * BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
        for p in tl.static_range(WORLD):
            if p != RANK:
                at = p * chunk + offs
                mask = (offs < chunk) & (at < n)
                peer_slot = _slot(tl.load(bases + p), half, RANK, x, FLAG_BYTES, WORLD, SLOT_ELEMS)
                tl.store(peer_slot + at, tl.load(x + at, mask=mask), mask=mask)
    busy = pid * BLOCK < chunk  # a program without elements has nothing to exchange
    if busy:
        _exchange_flags(bases, 0, pid, epoch, errors, RANK, WORLD, PROGRAMS, MAX_SPINS)
    own = tl.load(bases + RANK)
    for start in range(pid * BLOCK, chunk, PROGRAMS * BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
        at = RANK * chunk + offs
        mask = (offs < chunk) & (at < n)
        acc = _sum_in_rank_order(x, own, half, at, mask, RANK, WORLD, BLOCK, FLAG_BYTES, SLOT_ELEMS)
        total = acc.to(x.dtype.element_ty)
        tl.store(x + at, total, mask=mask)
        for p in tl.static_range(WORLD):
            if p != RANK:
                peer_slot = _slot(tl.load(bases + p), half, RANK, x, FLAG_BYTES, WORLD, SLOT_ELEMS)
                tl.store(peer_slot + at, total, mask=mask)
    if busy:
        _exchange_flags(bases, 1, pid, epoch, errors, RANK, WORLD, PROGRAMS, MAX_SPINS)
    for start in range(pid * BLOCK, chunk, PROGRAMS * BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(start + tl.arange(0, BLOCK), BLOCK), BLOCK)
        for p in tl.static_range(WORLD):
            if p != RANK:
                at = p * chunk + offs
                mask = (offs < chunk) & (at < n)
                gathered = tl.load(_slot(own, half, p, x, FLAG_BYTES, WORLD, SLOT_ELEMS) + at, mask=mask)
                tl.store(x + at, gathered, mask=mask)


@triton.jit
def one_shot_all_reduce_add_rmsnorm_kernel(x, residual, weight, out, residual_out, rows, cols, eps, bases, epochs,
                                           errors, RANK: tl.constexpr, WORLD: tl.constexpr,
                                           PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, FLAG_BYTES: tl.constexpr,
                                           SLOT_ELEMS: tl.constexpr, MAX_SPINS: tl.constexpr,
                                           PDL: tl.constexpr = False, GO_AHEAD: tl.constexpr = False,
                                           SPLIT: tl.constexpr = 1):
    """The one-shot all-reduce of ``x`` (``rows`` x ``cols``, contiguous) followed, in the same pass, by the
    residual add and RMSNorm of ``kernels/fused.py``'s ``add_rmsnorm``: ``residual_out = sum + residual`` and
    ``out = weight * rmsnorm(residual_out)``, rounded as there.

    ``SPLIT`` programs share each row (a group; rows ``group, group + PROGRAMS / SPLIT, ...``): each pushes, and
    stores the results of, one ``BLOCK / SPLIT`` slice, so that a row's bytes cross NVLink from ``SPLIT`` SMs. The
    norm needs the whole row: once the flags of its whole group are in, each program sums the whole row (the same
    statistics in each, bit for bit ``add_rmsnorm``'s). Summing only its slice and adding the group's partial sums
    of squares through memory was slower (a second wait, between the programs of one GPU)."""
    pid = tl.program_id(0)
    GROUPS: tl.constexpr = PROGRAMS // SPLIT
    SLICE: tl.constexpr = BLOCK // SPLIT
    group = pid // SPLIT
    part = pid % SPLIT
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    w = tl.load(weight + offs, mask=mask, other=0.0)
    epoch = _next_epoch(epochs, pid, PDL, GO_AHEAD)
    half = epoch % 2
    slice_offs = part * SLICE + tl.arange(0, SLICE)
    slice_mask = slice_offs < cols
    for row in range(group, rows, GROUPS):
        at = row * cols + slice_offs
        mine = tl.load(x + at, mask=slice_mask)
        for p in tl.static_range(WORLD):
            if p != RANK:
                peer_slot = _slot(tl.load(bases + p), half, RANK, x, FLAG_BYTES, WORLD, SLOT_ELEMS)
                tl.store(peer_slot + at, mine, mask=slice_mask)
    if group < rows:  # a group without rows has nothing to exchange
        _exchange_flags(bases, 0, pid, epoch, errors, RANK, WORLD, PROGRAMS, MAX_SPINS, group * SPLIT, SPLIT)
    own = tl.load(bases + RANK)
    mine_cols = mask & (offs // SLICE == part)
    for row in range(group, rows, GROUPS):
        at = row * cols + offs
        acc = _sum_in_rank_order(x, own, half, at, mask, RANK, WORLD, BLOCK, FLAG_BYTES, SLOT_ELEMS)
        summed = rounded_add(acc.to(x.dtype.element_ty), tl.load(residual + at, mask=mask, other=0.0))
        tl.store(residual_out + at, summed, mask=mine_cols)
        tl.store(out + at, rmsnorm_row(summed, w, cols, eps), mask=mine_cols)
