"""One kernel for the second half of a decoder layer at one token: ``o_proj``, the residual add and norm,
``gate_up`` with SiLU·mul, ``down_proj``, and the next layer's residual add and norm.

At one token each of those matmuls is a GEMV bound by reading its weight, and as separate kernels each loses a
few microseconds at its edges: the memory idles while the last programs finish, the next kernel launches and its
first loads wait. Here one program per SM runs the three GEMVs as phases of one launch: a program streams its share
of a weight's rows (a flat loop over (tile, K step), so loads stay in flight across tile boundaries), asks L2 for
its first rows of the next phase's weight, and waits at a grid-wide arrival count until every program's share is
stored. The next layer's norm is computed by the last program to finish, as in ``small_batch_kernels``.

A grid-wide wait needs every program resident at once: the launch has no more programs than SMs (each fits one)
and runs alone on its stream. The wait gives up after ``spin_limit`` polls (a flag records it) rather than hang.
Under ``TRITON_INTERPRET=1``, which runs programs one after another, or with ``persistent=False``, the phases run
as three launches of the same kernel instead, with no waits.

Imported only on a CUDA device (or under ``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from treadle.plugins.models.fused_kernels import rmsnorm_row, rounded_add

logger = logging.getLogger(__name__)

# Counters (int32): the two grid-wide waits, the count of programs done with the last phase, and a flag a wait
# sets when it gives up.
_FIRST_WAIT, _SECOND_WAIT, _DONE, _GAVE_UP = (tl.constexpr(index) for index in range(4))


@triton.jit
def _decode_mlp_kernel(Attended, W_o, S_o, Residual, Post_norm, post_eps, W_gu, S_gu, W_d, S_d, Next_norm, next_eps,
                       Y_o, Summed, Normed_rows, Act, Y_d, Normed_out, Residual_out, Counters, Prefetch,
                       prefetch_lines, hidden, k_o, inter, spin_limit,
                       PHASE: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_ROW: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATE_UP_BLOCK_N: tl.constexpr,
                       PREFETCH_NEXT_PHASE: tl.constexpr, PREFETCH: tl.constexpr):
    """PHASE 0 runs all three phases with grid-wide waits between them; 1, 2 and 3 run one phase each (one launch
    each, the stream ordering them)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_ROW)
    row_mask = cols < hidden
    if PHASE == 0 or PHASE == 1:
        _gemv_tiles(Attended, W_o, S_o, Y_o, hidden, k_o, pid, programs, False, False,
                    BLOCK_N, BLOCK_K, HAS_SCALE)
    if PHASE == 0:
        if PREFETCH_NEXT_PHASE:
            _prefetch_first_tile(W_gu, pid, hidden, GATE_UP_BLOCK_N)
            _prefetch_first_tile(W_gu + inter.to(tl.int64) * hidden, pid, hidden, GATE_UP_BLOCK_N)
        _wait_for_all(Counters + _FIRST_WAIT, programs, Counters + _GAVE_UP, spin_limit)
    if PHASE == 0 or PHASE == 2:
        # Every program adds the residual and norms the whole row for itself (16 KB from L2), so no third wait;
        # program 0 keeps the sum for the last phase.
        summed = rounded_add(tl.load(Y_o + cols, mask=row_mask, other=0.0, cache_modifier=".cg"),
                             tl.load(Residual + cols, mask=row_mask, other=0.0))
        if pid == 0:
            tl.store(Summed + cols, summed, mask=row_mask)
        normed_row = Normed_rows + pid.to(tl.int64) * hidden
        tl.store(normed_row + cols, rmsnorm_row(summed, tl.load(Post_norm + cols, mask=row_mask, other=0.0),
                                                hidden, post_eps), mask=row_mask)
        tl.debug_barrier()  # the row is stored before the program's threads read other parts of it
        _gemv_tiles(normed_row, W_gu, S_gu, Act, inter, hidden, pid, programs, False, True,
                    GATE_UP_BLOCK_N, BLOCK_K, HAS_SCALE)
    if PHASE == 0:
        if PREFETCH_NEXT_PHASE:
            _prefetch_first_tile(W_d, pid, inter, BLOCK_N)
        _wait_for_all(Counters + _SECOND_WAIT, programs, Counters + _GAVE_UP, spin_limit)
    if PHASE == 0 or PHASE == 3:
        _gemv_tiles(Act, W_d, S_d, Y_d, hidden, inter, pid, programs, True, False, BLOCK_N, BLOCK_K, HAS_SCALE)
        tl.debug_barrier()  # every thread's stores are issued before the count releases them
        if tl.atomic_add(Counters + _DONE, 1, sem="acq_rel") == programs - 1:
            # The last program: the next layer's residual and norm, and the counters reset for the next call
            # (every program has passed both waits by now).
            x = rounded_add(tl.load(Y_d + cols, mask=row_mask, other=0.0, cache_modifier=".cg"),
                            tl.load(Summed + cols, mask=row_mask, other=0.0, cache_modifier=".cg"))
            tl.store(Residual_out + cols, x, mask=row_mask)
            tl.store(Normed_out + cols, rmsnorm_row(x, tl.load(Next_norm + cols, mask=row_mask, other=0.0),
                                                    hidden, next_eps), mask=row_mask)
            tl.atomic_xchg(Counters + _FIRST_WAIT, 0, sem="relaxed")
            tl.atomic_xchg(Counters + _SECOND_WAIT, 0, sem="relaxed")
            tl.atomic_xchg(Counters + _DONE, 0, sem="relaxed")
        if PREFETCH:
            _prefetch_lines(Prefetch, prefetch_lines, pid, programs)


@triton.jit
def _gemv_tiles(X, W, Scale, Y, n, k, pid, programs, X_FROM_OTHERS: tl.constexpr, SILU_MUL: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALE: tl.constexpr):
    """``y = x @ (W * Scale).T`` (``n`` outputs; with ``SILU_MUL`` W is ``[gate | up]`` of 2n rows and y
    ``silu(gate) * up``) for the tiles of ``BLOCK_N`` rows ``pid``, ``pid + programs``, ...: one flat loop over
    (tile, K step) that loads the next step's weight before it reduces this one's, so one program per SM keeps two
    steps of reads in flight, across tile boundaries too (Triton does not pipeline loads that feed no ``tl.dot``).
    ``n`` and ``k`` are multiples of the blocks. ``X_FROM_OTHERS``: x was stored by other programs of this launch
    (read from L2)."""
    k_steps = k // BLOCK_K
    steps = tl.cdiv(n // BLOCK_N - pid, programs) * k_steps
    offs_k = tl.arange(0, BLOCK_K)
    w, w_up = _weight_step(W, 0, steps, k_steps, pid, programs, n, k, SILU_MUL, BLOCK_N, BLOCK_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_N], tl.float32)
    for step in range(0, steps):
        w_this, w_up_this = w, w_up
        w, w_up = _weight_step(W, step + 1, steps, k_steps, pid, programs, n, k, SILU_MUL, BLOCK_N, BLOCK_K)
        k_start = (step % k_steps) * BLOCK_K
        if X_FROM_OTHERS:
            x = tl.load(X + k_start + offs_k, cache_modifier=".cg").to(tl.float32)
        else:
            x = tl.load(X + k_start + offs_k).to(tl.float32)
        acc += tl.sum(w_this.to(tl.float32) * x[None, :], axis=1)
        if SILU_MUL:
            acc_up += tl.sum(w_up_this.to(tl.float32) * x[None, :], axis=1)
        if step % k_steps == k_steps - 1:
            offs_n = (pid + (step // k_steps) * programs) * BLOCK_N + tl.arange(0, BLOCK_N)
            if SILU_MUL:
                _store_silu_mul_row(Y, Scale, acc, acc_up, offs_n, n, HAS_SCALE)
            else:
                if HAS_SCALE:
                    acc = acc * tl.load(Scale + offs_n)
                tl.store(Y + offs_n, acc.to(Y.dtype.element_ty))
            acc = tl.zeros([BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_N], tl.float32)


@triton.jit
def _weight_step(W, step, steps, k_steps, pid, programs, n, k, SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The weight tile of loop step ``step`` of :func:`_gemv_tiles` (past the last, the last again: an L2 hit, and
    unmasked loads stay vectorized), and with ``SILU_MUL`` the matching tile of the up half (else the same tile)."""
    step = tl.minimum(step, steps - 1)
    offs_n = (pid + (step // k_steps) * programs) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = (step % k_steps) * BLOCK_K + tl.arange(0, BLOCK_K)
    w_ptrs = W + offs_n[:, None].to(tl.int64) * k + offs_k[None, :]
    # The weight is read once per call: evict_first keeps it from pushing x out of L2.
    w = tl.load(w_ptrs, eviction_policy="evict_first")
    if SILU_MUL:
        w_up = tl.load(w_ptrs + n.to(tl.int64) * k, eviction_policy="evict_first")
    else:
        w_up = w
    return w, w_up


@triton.jit
def _store_silu_mul_row(Y, Scale, gate, up, offs_n, n, HAS_SCALE: tl.constexpr):
    """``silu(gate) * up`` for columns ``offs_n``, rounded where the separate matmul and silu_mul kernels round."""
    if HAS_SCALE:
        gate = gate * tl.load(Scale + offs_n)
        up = up * tl.load(Scale + n + offs_n)
    dtype = Y.dtype.element_ty
    g = gate.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype)
    tl.store(Y + offs_n, (silu.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype))


@triton.jit
def _wait_for_all(Counter, programs, Gave_up, spin_limit):
    """Counts this program in and polls until all ``programs`` are (their stores then visible: the count is
    released and acquired); after ``spin_limit`` polls it sets ``Gave_up`` and goes on."""
    tl.debug_barrier()  # every thread's stores are issued before the count releases them
    arrived = tl.atomic_add(Counter, 1, sem="acq_rel") + 1
    polls = 0
    while (arrived < programs) & (polls < spin_limit):
        arrived = tl.atomic_add(Counter, 0, sem="acquire")
        polls += 1
    if arrived < programs:
        tl.atomic_xchg(Gave_up, 1, sem="relaxed")


@triton.jit
def _prefetch_first_tile(W, pid, k, BLOCK_N: tl.constexpr):
    """Asks L2 for rows ``[pid * BLOCK_N, (pid + 1) * BLOCK_N)`` of the ``k``-column weight ``W`` (the first
    tile this program reads in the next phase) while it waits for the others."""
    start = pid.to(tl.int64) * BLOCK_N * k * W.dtype.element_ty.primitive_bitwidth // 8
    lines = BLOCK_N * k * W.dtype.element_ty.primitive_bitwidth // 8 // 128
    base = W.to(tl.pointer_type(tl.uint8)) + start
    for first in range(0, lines, 256):
        line = tl.minimum(first + tl.arange(0, 256), lines - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                  [base + line.to(tl.int64) * 128], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_lines(Prefetch, lines, pid, programs):
    """This program's share of the ``lines`` 128-byte lines at ``Prefetch`` (the head of the next layer's
    weight), asked of L2 as the program finishes."""
    per = tl.cdiv(lines, programs)
    start = pid * per
    end = tl.minimum(start + per, lines)
    for first in range(start, end, 64):
        line = tl.minimum(first + tl.arange(0, 64), end - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                  [Prefetch + line.to(tl.int64) * 128], dtype=tl.int32, is_pure=False, pack=1)


class DecodeMlpTiles(NamedTuple):
    """Launch shape of :func:`decode_mlp`: ``block_n`` weight rows by ``block_k`` columns per loop step
    (``gate_up_block_n`` rows of each half for ``gate_up``), ``num_warps`` and ``num_stages`` of the loop's
    software pipeline."""

    block_n: int
    block_k: int
    gate_up_block_n: int
    num_warps: int
    num_stages: int


# 16 KB of weight per loop step for o_proj and down_proj (twice that for gate_up's two halves), one program of
# 8 warps per SM: three steps in flight per SM keep ~6 MB of reads outstanding on an H100.
FP8_TILES = DecodeMlpTiles(block_n=8, block_k=2048, gate_up_block_n=8, num_warps=8, num_stages=4)
SIXTEEN_BIT_TILES = DecodeMlpTiles(block_n=4, block_k=2048, gate_up_block_n=4, num_warps=8, num_stages=4)


def tiles_for(weight_dtype: torch.dtype) -> DecodeMlpTiles:
    """The tiles for weights of ``weight_dtype`` (``TREADLE_DECODE_MLP_TILES=block_n:block_k:gate_up_block_n:
    num_warps:num_stages`` overrides them, for sweeps)."""
    override = os.environ.get("TREADLE_DECODE_MLP_TILES")
    if override:
        return DecodeMlpTiles(*(int(value) for value in override.split(":")))
    return FP8_TILES if weight_dtype.itemsize == 1 else SIXTEEN_BIT_TILES


def fits(tiles: DecodeMlpTiles, hidden: int, k_o: int, inter: int) -> bool:
    """Whether the kernel's unmasked tiles cover these sizes exactly."""
    return (hidden % tiles.block_n == 0 and inter % tiles.gate_up_block_n == 0 and
            all(k % tiles.block_k == 0 for k in (hidden, k_o, inter)))


class DecodeMlpWeights(NamedTuple):
    """The weights :func:`decode_mlp` reads: ``[out, in]`` matrices (16-bit, or FP8 with a float32 scale
    ``[out, 1]`` per row), the post-attention and next norms' weights and epsilons."""

    o_proj: torch.Tensor
    o_scale: torch.Tensor | None
    post_norm: torch.Tensor
    post_eps: float
    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor | None
    down: torch.Tensor
    down_scale: torch.Tensor | None
    next_norm: torch.Tensor
    next_eps: float


_counters: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor:
    """The zeroed int32 counters of the grid-wide waits on ``device`` (the last is the gave-up flag), shared by
    every call: the layers run one after another on one stream. Created at the first call, before any capture."""
    if device not in _counters:
        _counters[device] = torch.zeros(4, dtype=torch.int32, device=device)
    return _counters[device]


def decode_mlp(attended: torch.Tensor, residual: torch.Tensor, weights: DecodeMlpWeights,
               prefetch: torch.Tensor | None = None, persistent: bool | None = None,
               programs: int | None = None, spin_limit: int = 1 << 20) -> tuple[torch.Tensor, torch.Tensor]:
    """For one token (``attended`` [1, k_o], the attention output; ``residual`` [1, hidden]): with
    ``s = attended @ o_proj.T + residual``, ``h = silu(gate) * up`` of ``rmsnorm(s) @ gate_up.T`` and
    ``r = h @ down.T + s``, returns ``(next_norm(r), r)``, rounded where the separate kernels round.

    ``persistent`` (default: on a GPU, not interpreted) runs the phases in one launch of ``programs`` (default:
    as many as the GPU holds at once, see :func:`_resident_programs`) with grid-wide waits; otherwise three
    launches (of 4 programs by default). ``prefetch``: bytes the last phase asks L2 for."""
    device = attended.device
    w = weights
    hidden, k_o = w.o_proj.shape
    inter = w.down.shape[1]
    tiles = tiles_for(w.o_proj.dtype)
    if not fits(tiles, hidden, k_o, inter):
        raise ValueError(f"decode_mlp's tiles {tiles} do not cover hidden {hidden}, o_proj input {k_o}, "
                         f"intermediate {inter}")
    if persistent is None:
        persistent = device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
    dtype = attended.dtype
    y_o, summed, y_d = (torch.empty(hidden, dtype=dtype, device=device) for _ in range(3))
    act = torch.empty(inter, dtype=dtype, device=device)
    normed, residual_out = torch.empty((1, hidden), dtype=dtype, device=device), torch.empty_like(residual)
    has_scale = w.o_scale is not None
    lines = prefetch.numel() // 128 if prefetch is not None else 0
    constexprs = dict(HAS_SCALE=has_scale, BLOCK_ROW=triton.next_power_of_2(hidden), BLOCK_N=tiles.block_n,
                      BLOCK_K=tiles.block_k, GATE_UP_BLOCK_N=tiles.gate_up_block_n,
                      PREFETCH_NEXT_PHASE=os.environ.get("TREADLE_DECODE_MLP_PREFETCH", "1") != "0",
                      PREFETCH=lines > 0, num_warps=tiles.num_warps, num_stages=tiles.num_stages)

    def arguments(programs: int) -> tuple:
        return (attended.contiguous(), w.o_proj, w.o_scale if has_scale else w.o_proj, residual.contiguous(),
                w.post_norm, w.post_eps, w.gate_up, w.gate_up_scale if has_scale else w.gate_up,
                w.down, w.down_scale if has_scale else w.down, w.next_norm, w.next_eps,
                y_o, summed, torch.empty((programs, hidden), dtype=dtype, device=device), act, y_d, normed,
                residual_out, counters(device), prefetch if lines else y_o, lines, hidden, k_o, inter, spin_limit)

    if programs is None:
        programs = _resident_programs(arguments(1), constexprs, device) if persistent else 4
    # Every program has a tile in each phase (its loop re-reads its last tile past the end).
    programs = min(programs, hidden // tiles.block_n, inter // tiles.gate_up_block_n)
    args = arguments(programs)
    for phase in ((0,) if persistent else (1, 2, 3)):
        _decode_mlp_kernel[(programs,)](*args, PHASE=phase, **constexprs)
    return normed, residual_out


_resident: dict[tuple, int] = {}


def _resident_programs(args: tuple, constexprs: dict, device: torch.device) -> int:
    """How many programs of the one-launch kernel the GPU holds at once (its registers, threads and shared memory
    per SM, at most ``TREADLE_DECODE_MLP_CTAS`` per SM, default 4): all of them must be resident for the grid-wide
    waits to finish."""
    cap = int(os.environ.get("TREADLE_DECODE_MLP_CTAS", "4"))
    key = (str(device), cap, tuple(sorted(constexprs.items())), tuple(str(a.dtype) for a in args[:3]))
    if key not in _resident:
        compiled = _decode_mlp_kernel.warmup(*args, grid=(1,), PHASE=0, **constexprs)
        compiled._init_handles()
        props = torch.cuda.get_device_properties(device)
        warps = constexprs["num_warps"]
        # Registers are allocated per warp in units of 256.
        regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256
        per_sm = min(getattr(props, "regs_per_multiprocessor", 65536) // (regs_per_warp * warps),
                     getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps),
                     getattr(props, "shared_memory_per_multiprocessor", 228 << 10)
                     // (compiled.metadata.shared + 1024), cap)
        _resident[key] = props.multi_processor_count * max(per_sm, 1)
        logger.info("decode MLP kernel: %d registers a thread, %d shared bytes, %d programs an SM",
                    compiled.n_regs, compiled.metadata.shared, max(per_sm, 1))
    return _resident[key]
