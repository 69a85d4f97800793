"""Triton fused-MoE kernels for integer experts (W4A16, W8A16) in ``layers/packed_int.py``'s panel layout, behind
``layers/int_experts.py``'s :func:`fused_int_experts`.

A decode step of a few tokens (fewer assignments than experts, as 16-bit experts: ``kernels/fused_moe.py``) runs two
GEMVs per (token, expert) assignment, the one-token integer GEMV's loop (``kernels/packed_int.py``) on the
assignment's expert — the first with ``silu(gate) * up`` in its epilogue, the second summing the token's ``k``
routed outputs — so nothing is sorted or padded. Larger batches sort the assignments by expert (``align_by_expert``)
and run a grouped GEMM, one of three forms (:func:`choose_form`, by the batch's shape):

- ``magic`` (4-bit, groups of whole 128-value panels, 16-bit rows): ``kernels/packed_int_moe_magic.py``'s tiles,
  which widen each weight tile once for ``block_m`` rows by ``magic_mma``'s packed pairs;
- ``grouped``: tiles that widen each panel of their expert's packed weight value slot by value slot for 16-row
  ``tl.dot``s (every other shape);
- ``dequant`` (from :data:`DEQUANT_ROWS_PER_EXPERT` rows per expert, where the layer has a scratch): the experts
  widened into one 16-bit scratch ``[E, I, H]`` by one bandwidth-bound kernel (the gate rows, the up rows, then
  down, each before its GEMM), then the 16-bit grouped GEMM of ``kernels/fused_moe.py`` on it. The extra traffic
  (about 4 bytes a parameter) is small against the compute of a large batch, and the 16-bit GEMM runs at the
  tensor cores' pace.

Nothing syncs with the host: the layer captures in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

import torch
import triton
import triton.language as tl

from treadle.kernels.fused_moe import BlockConfig, _grouped_gemm, align_by_expert, default_config, takes_gemv
from treadle.kernels.fused_ops import silu_mul
from treadle.kernels.packed_int import _dot_panels, _gemv_rows, widening
from treadle.kernels.packed_int_dequant import dequantize
from treadle.kernels.packed_int_moe_magic import (GroupedMagicTiles, _sorted_block_rows, default_magic_tiles,
                                                  grouped_magic, magic_fits)

# Weight rows, words per step and warps of a GEMV program: the gate/up GEMV has two row blocks per program and
# top_k * I / 16 programs per token; the down GEMV's H / 8 programs per token each read top_k experts' rows.
_GEMV_ROWS, _GEMV_WORDS, _GEMV_WARPS = 16, 32, 2
_DOWN_ROWS, _DOWN_WARPS = 8, 1


# The forms :func:`fused_int_experts` runs: the decode GEMVs, the grouped GEMM widening value slots for 16-row dots
# (``_dot_panels``), the grouped GEMM with magic_mma's widening (``kernels/packed_int_moe_magic.py``), and the experts
# dequantized into a 16-bit scratch for the 16-bit grouped GEMM (``kernels/fused_moe.py``).
FORMS = ("gemv", "grouped", "magic", "dequant")
# Sorted rows per expert from which the experts are dequantized (with a scratch to hold them). Measured on an H200
# (2026-11-28, one Mixtral-8x7B layer, `bench/quant_kernels.py --moe-only`): the magic grouped GEMM took 1.13 / 1.96 /
# 6.29 ms at 256 / 512 / 2048 tokens (64 / 128 / 512 rows per expert) against the 16-bit grouped GEMM's 1.62 / 1.11 /
# 2.95 ms on 16-bit experts; the dequant form adds the widening of every expert (~3.5 GB moved a layer, ~1 ms at the
# dense dequantize kernel's 78-87% of the copy bandwidth), so it wins from ~200 rows per expert (Mixtral: ~800 tokens,
# prefill chunks; its 512-request decode steps stay on magic).
# TREADLE_INT_MOE_DEQUANT_ROWS overrides it for A/B runs (0: never).
DEQUANT_ROWS_PER_EXPERT = 256


def dequant_rows_per_expert() -> int:
    """Rows per expert from which the experts run dequantized (0: never; ``TREADLE_INT_MOE_DEQUANT_ROWS``)."""
    return int(os.environ.get("TREADLE_INT_MOE_DEQUANT_ROWS", DEQUANT_ROWS_PER_EXPERT))


def choose_form(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, bits: int, group: int,
                dtype: torch.dtype, has_scratch: bool) -> str:
    """What a batch of ``num_tokens`` runs (one of :data:`FORMS`), from its shape alone (no host sync)."""
    if takes_gemv(num_tokens, top_k, num_experts):
        return "gemv"
    threshold = dequant_rows_per_expert()
    if has_scratch and threshold and num_tokens * top_k >= threshold * num_experts:
        return "dequant"
    return "magic" if magic_fits(hidden, inter, bits, group, dtype) else "grouped"


def fused_int_experts(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, z13: torch.Tensor | None,
                      w2: torch.Tensor, s2: torch.Tensor, z2: torch.Tensor | None, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, bits: int, group: int, scratch: torch.Tensor | None = None,
                      form: str | None = None, tiles: GroupedMagicTiles | BlockConfig | None = None) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` for packed experts: ``w13`` int32
    ``[E, 2I, H * bits / 32]`` with ``s13`` / ``z13`` ``[E, 2I, H / group]``, ``w2`` ``[E, H, I * bits / 32]``
    with ``s2`` / ``z2`` ``[E, H, I / group]`` (zeros None: symmetric). ``scratch``: at least ``E * I * H``
    elements of ``x``'s dtype that the ``dequant`` form widens the experts into, gate/up half by half (None: that
    form is not chosen); ``form`` (one of :data:`FORMS`) and ``tiles`` (the grouped GEMM's: ``GroupedMagicTiles``
    for ``magic``, a ``BlockConfig`` otherwise) override the choice, for the benchmark."""
    x = x.contiguous()
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    form = form or choose_form(num_tokens, top_k, num_experts, hidden, two_inter // 2, bits, group, x.dtype,
                               scratch is not None)
    if form == "gemv":
        return _gemvs(x, w13, s13, z13, w2, s2, z2, weights, topk_ids, bits, group)
    num_rows = num_tokens * top_k
    if form == "magic":
        magic = tiles if isinstance(tiles, GroupedMagicTiles) else default_magic_tiles(num_rows, num_experts)
        if not x.is_cuda:  # the interpreter runs no inline PTX
            magic = dataclasses.replace(magic, asm=False)
        gemm = functools.partial(grouped_magic, bits=bits, group=group, tiles=magic)
        return _by_expert(x, (w13, s13, z13), (w2, s2, z2), weights, topk_ids, magic.block_m, gemm)
    config = tiles if isinstance(tiles, BlockConfig) else default_config(num_rows, x.dtype)
    if form == "dequant":
        if scratch is None:
            raise ValueError("the dequant form needs a scratch for the 16-bit experts")
        gemm = functools.partial(_dequantized_gemm, bits=bits, group=group, scratch=scratch, config=config)
    else:
        gemm = functools.partial(_grouped, bits=bits, group=group, config=config)
    return _by_expert(x, (w13, s13, z13), (w2, s2, z2), weights, topk_ids, config.block_m, gemm)


def _by_expert(x: torch.Tensor, gate_up: tuple, down: tuple, weights: torch.Tensor, topk_ids: torch.Tensor,
               block_m: int, gemm: Callable[..., None]) -> torch.Tensor:
    """The grouped forms: the assignments sorted by expert (runs padded to ``block_m``), ``gemm(a, words, scales,
    zeros, out, sorted_rows, block_experts, a_row_divisor, row_weights)`` for gate/up, ``silu(gate) * up``, then
    ``gemm`` for down scaled by the routing weights, and each token's ``k`` outputs summed."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_rows = num_tokens * top_k
    sorted_rows, block_experts = align_by_expert(topk_ids, gate_up[0].shape[0], block_m)
    gate_up_out = torch.empty((num_rows, gate_up[0].shape[1]), dtype=x.dtype, device=x.device)
    gemm(x, *gate_up, gate_up_out, sorted_rows, block_experts, top_k, None)
    activated = silu_mul(gate_up_out)
    down_out = torch.empty((num_rows, hidden), dtype=x.dtype, device=x.device)
    gemm(activated, *down, down_out, sorted_rows, block_experts, 1, weights)
    return down_out.view(num_tokens, top_k, hidden).sum(dim=1)


def dequantize_experts(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group: int,
                       scratch: torch.Tensor) -> torch.Tensor:
    """Every expert's weight ``[E, N, K]`` in ``scratch``'s dtype, widened into (the head of) ``scratch`` by the dense
    weights' bandwidth-bound kernel (kernels/packed_int_dequant.py: the same panel layout). ``words`` ``[E, N, K *
    bits / 32]`` may be a slice of rows of a larger tensor (gate/up's halves), with its ``scales`` / ``zeros`` ``[E,
    N, K / group]`` sliced alike: then one launch per expert, else one for all."""
    num_experts, n, num_words = words.shape
    k = num_words * 32 // bits
    if scratch.numel() < num_experts * n * k:
        raise ValueError(f"a scratch of {scratch.numel()} elements holds no {num_experts} x {n} x {k} experts")
    if words.stride(2) != 1 or scales.stride(2) != 1 or (zeros is not None and zeros.stride() != scales.stride()):
        raise ValueError("the experts' words, scales and zeros must be contiguous along K, zeros strided as scales")
    widened = scratch[:num_experts * n * k].view(num_experts, n, k)
    whole = words.is_contiguous() and scales.is_contiguous()
    parts = [(words, scales, zeros, widened)] if whole else [
        (words[e], scales[e], zeros[e] if zeros is not None else None, widened[e]) for e in range(num_experts)]
    for w, s, z, out in parts:
        groups = s.shape[-1]
        dequantize(w.reshape(-1, num_words), s.reshape(-1, groups), None if z is None else z.reshape(-1, groups), None,
                   bits, group, widened.dtype, out=out.reshape(-1, k))
    return widened


def _dequantized_gemm(a: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                      out: torch.Tensor, sorted_rows: torch.Tensor, block_experts: torch.Tensor, a_row_divisor: int,
                      row_weights: torch.Tensor | None, bits: int, group: int, scratch: torch.Tensor,
                      config: BlockConfig) -> None:
    # One scratch of E x I x H for every GEMM of every layer: gate/up runs as two GEMMs (the gate rows, then the up
    # rows, each into its half of the output's columns), so the scratch holds half of the experts' gate/up weight;
    # the stream orders each widening after the GEMM that read the last. Gate/up is the GEMM without routing
    # weights (``_by_expert`` scales down's rows).
    n = words.shape[1]
    halves = (slice(0, n // 2), slice(n // 2, n)) if row_weights is None else (slice(None),)
    for rows in halves:
        widened = dequantize_experts(words[:, rows], scales[:, rows], zeros[:, rows] if zeros is not None else None,
                                     bits, group, scratch)
        _grouped_gemm(a, None, widened, out[:, rows], sorted_rows, block_experts, config, a_row_divisor, row_weights)


def _gemvs(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, z13: torch.Tensor | None, w2: torch.Tensor,
           s2: torch.Tensor, z2: torch.Tensor | None, weights: torch.Tensor, topk_ids: torch.Tensor, bits: int,
           group: int) -> torch.Tensor:
    num_tokens, hidden = x.shape
    inter, top_k = w13.shape[1] // 2, topk_ids.shape[1]
    ids = topk_ids.reshape(-1).contiguous()
    activated = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    _moe_int_gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, _GEMV_ROWS))](
        x, w13, s13, z13 if z13 is not None else s13, ids, activated, hidden, inter, top_k, w13.stride(0),
        w13.stride(1), s13.stride(0), s13.stride(1), BITS=bits, GROUP=group, HAS_ZEROS=z13 is not None,
        BLOCK_N=_GEMV_ROWS, BLOCK_W=_block_words(hidden, bits), num_warps=_GEMV_WARPS)
    out = torch.empty_like(x)
    _moe_int_down_kernel[(num_tokens, triton.cdiv(hidden, _DOWN_ROWS))](
        activated, w2, s2, z2 if z2 is not None else s2, ids, weights, out, hidden, inter, w2.stride(0),
        w2.stride(1), s2.stride(0), s2.stride(1), TOP_K=top_k, BITS=bits, GROUP=group, HAS_ZEROS=z2 is not None,
        BLOCK_N=_DOWN_ROWS, BLOCK_W=_block_words(inter, bits), num_warps=_DOWN_WARPS)
    return out


def _block_words(k: int, bits: int) -> int:
    return _GEMV_WORDS if (k * bits // 32) % _GEMV_WORDS == 0 else 16


def _grouped(a: torch.Tensor, weights: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
             out: torch.Tensor, sorted_rows: torch.Tensor, block_experts: torch.Tensor, a_row_divisor: int,
             row_weights: torch.Tensor | None, bits: int, group: int, config: BlockConfig) -> None:
    """``out[r] = a[r // a_row_divisor] @ dequantized(weights[expert(r)]).T`` (times ``row_weights[r]``) for each
    sorted row ``r``."""
    _, n, _ = weights.shape
    i16, magic, offset = widening(bits, a.dtype)
    _grouped_int_kernel[(block_experts.numel(), triton.cdiv(n, config.block_n))](
        a, weights, scales, zeros if zeros is not None else scales, out,
        row_weights if row_weights is not None else out, sorted_rows, block_experts, n, a.shape[1], out.shape[0],
        a_row_divisor, a.stride(0), weights.stride(0), weights.stride(1), scales.stride(0), scales.stride(1),
        out.stride(0), BITS=bits, GROUP=group, HAS_ZEROS=zeros is not None, I16=i16, MAGIC16=magic,
        OFFSET16=offset, MUL_ROW_WEIGHT=row_weights is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        num_warps=config.num_warps)


@triton.jit
def _moe_int_gate_up_kernel(x_ptr, w_ptr, s_ptr, z_ptr, ids_ptr, out_ptr, K, inter, top_k, stride_we, stride_wn,
                            stride_se, stride_sn, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    assignment = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    expert = tl.load(ids_ptr + assignment).to(tl.int64)
    x_row = x_ptr + (assignment // top_k).to(tl.int64) * K
    w, s, z = w_ptr + expert * stride_we, s_ptr + expert * stride_se, z_ptr + expert * stride_se
    gate = _gemv_rows(x_row, w, s, z, offs_n, n_mask, 0, K, stride_wn, stride_sn, BITS, GROUP, HAS_ZEROS, BLOCK_N,
                      BLOCK_W, False)
    up = _gemv_rows(x_row, w, s, z, offs_n + inter, n_mask, 0, K, stride_wn, stride_sn, BITS, GROUP, HAS_ZEROS,
                    BLOCK_N, BLOCK_W, False)
    dtype = out_ptr.dtype.element_ty
    # Rounded where the grouped path rounds: the gate/up products, then silu(gate) * up.
    gate = gate.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + assignment.to(tl.int64) * inter + offs_n, (silu * up.to(dtype).to(tl.float32)).to(dtype),
             mask=n_mask)


@triton.jit
def _moe_int_down_kernel(act_ptr, w_ptr, s_ptr, z_ptr, ids_ptr, route_ptr, out_ptr, hidden, K, stride_we, stride_wn,
                         stride_se, stride_sn, TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                         HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        assignment = token * TOP_K + j
        expert = tl.load(ids_ptr + assignment).to(tl.int64)
        acc = _gemv_rows(act_ptr + assignment * K, w_ptr + expert * stride_we, s_ptr + expert * stride_se,
                         z_ptr + expert * stride_se, offs_n, n_mask, 0, K, stride_wn, stride_sn, BITS, GROUP,
                         HAS_ZEROS, BLOCK_N, BLOCK_W, False)
        # Each routed output rounded as the grouped path stores it, then summed in float32 as its sum over k does.
        total += (acc * tl.load(route_ptr + assignment)).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * hidden + offs_n, total.to(dtype), mask=n_mask)


@triton.jit(do_not_specialize=["num_rows"])
def _grouped_int_kernel(a_ptr, w_ptr, s_ptr, z_ptr, c_ptr, row_weight_ptr, sorted_rows_ptr, block_experts_ptr, N, K,
                        num_rows, a_row_divisor, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
                        BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, I16: tl.constexpr,
                        MAGIC16: tl.constexpr, OFFSET16: tl.constexpr, MUL_ROW_WEIGHT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows, row_mask, a_rows = _sorted_block_rows(sorted_rows_ptr, pid_m, num_rows, a_row_divisor, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_c = tl.arange(0, 16)
    acc = _dot_panels(a_ptr + a_rows[:, None] * stride_am + offs_c[None, :], row_mask,
                      w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_c[:, None],
                      s_ptr + expert * stride_se, z_ptr + expert * stride_se, offs_n, n_mask, 0, K, stride_sn, BITS,
                      GROUP, HAS_ZEROS, I16, MAGIC16, OFFSET16, BLOCK_M, BLOCK_N)
    if MUL_ROW_WEIGHT:
        acc = acc * tl.load(row_weight_ptr + rows, mask=row_mask, other=0.0)[:, None]
    tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])
