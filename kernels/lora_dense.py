"""The dense form of a layer's LoRA deltas, for batches of many tokens (the ``triton`` backend's ``add_delta`` past
``LoRAKernelChoice.dense_above`` tokens): no per-token gather and no sort; the arithmetic runs as library GEMMs over
every adapter slot at once, and a one-hot mask keeps each token's own slot.

- shrink: ``every = x @ A_all.T``, ``A_all`` the layer's stacked ``a`` viewed ``[slots * P * R, in]`` (a free view:
  the slots are stored so), one cuBLAS GEMM for a fused layer's ``P`` projections;
- mask: ``every`` viewed ``[T, slots, P, R]``, each token's slot kept and the others zeroed (all of them for a token
  without an adapter: CUDA-graph padding, the base model's tokens), written as ``[T, P, slots, R]`` so that each
  projection's rows are one ``[T, slots * R]`` matrix; one Triton launch that reads the slot ids on the device;
- expand: ``out[:, segment p] += masked[:, p] @ dense_b[:, :, segment p]``, ``dense_b`` viewed ``[slots * R,
  width]`` (every slot's ``B`` transposed with its scaling folded in, made when an adapter is loaded:
  ``StackedLoRA.dense_b``), one cuBLAS GEMM per projection accumulating into the layer's output in place (beta = 1,
  the old value and the delta summed in float32 and rounded once); adjacent projections of one width (k and v,
  gate and up) share one strided batched GEMM, so a layer of all seven projections runs 5 expands.

Padded ranks are zero rows of ``a`` and ``dense_b``, so mixed ranks need nothing. The extra work is ``slots * R *
(in + out)`` multiply-adds a token whatever adapters the batch holds, at cuBLAS efficiency, and every slot's ``A`` and
``B`` read once per layer and step. Shapes depend on the number of tokens only and nothing is read on the host, so
CUDA graphs capture it and replay it with other ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MASK_TILE = 4096  # elements of ``every`` a mask program moves


def add_delta_dense(x: torch.Tensor, a: torch.Tensor, dense_b: torch.Tensor, adapter_ids: torch.Tensor,
                    segments: tuple[tuple[int, int], ...], out: torch.Tensor) -> None:
    """``out[t, start:end] += dense_b[s, :, start:end].T @ (x[t] @ a[s, p * R:(p + 1) * R].T)`` for each token's
    slot ``s`` (none for ``adapter_ids[t] < 0``) and projection ``p`` on columns ``segments[p]``: ``a`` ``[slots, P *
    R, in]``, ``dense_b`` ``[slots, R, width]`` (scalings folded in), ``out`` the layer's output, changed in place."""
    num_tokens = x.shape[0]
    slots, rows, in_features = a.shape
    rank = dense_b.shape[1]
    every = torch.mm(x, a.reshape(slots * rows, in_features).t())
    masked = torch.empty((num_tokens, rows // rank, slots, rank), dtype=x.dtype, device=x.device)
    block_rank = triton.next_power_of_2(rank)
    block_tokens = max(1, min(64, _MASK_TILE // triton.next_power_of_2(block_rank * (rows // rank))))
    _keep_own_slot[(triton.cdiv(num_tokens, block_tokens), slots)](
        every, adapter_ids, masked, num_tokens, slots, rank, rows // rank, block_tokens, block_rank)
    stacked_b = dense_b.reshape(slots * rank, dense_b.shape[2])
    for first, count in _equal_width_runs(segments):
        start, width = segments[first][0], segments[first][1] - segments[first][0]
        if count == 1:
            out[:, start:start + width].addmm_(masked[:, first].reshape(num_tokens, slots * rank),
                                               stacked_b[:, start:start + width])
            continue
        # Side by side projections of one width (k and v, gate and up): one strided batched GEMM.
        end = start + count * width
        out[:, start:end].unflatten(1, (count, width)).transpose(0, 1).baddbmm_(
            masked[:, first:first + count].flatten(2).transpose(0, 1),
            stacked_b[:, start:end].unflatten(1, (count, width)).transpose(0, 1))


def _equal_width_runs(segments: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """``(first projection, count)`` for each run of adjacent projections of one width, in order."""
    runs: list[tuple[int, int]] = []
    for p, (start, end) in enumerate(segments):
        if runs:
            first, count = runs[-1]
            first_start, first_end = segments[first]
            if end - start == first_end - first_start and start == first_start + count * (first_end - first_start):
                runs[-1] = (first, count + 1)
                continue
        runs.append((p, 1))
    return runs


@triton.jit(do_not_specialize=["num_tokens"])  # one compile for every batch size
def _keep_own_slot(every_ptr, ids_ptr, masked_ptr, num_tokens, SLOTS: tl.constexpr, RANK: tl.constexpr,
                   PARTS: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCK_RANK: tl.constexpr):
    """Program (block of tokens, slot): the slot's ``PARTS * RANK`` columns of ``every`` [T, SLOTS * PARTS * RANK]
    for the tokens of that slot, zeros for the others, into ``masked`` [T, PARTS, SLOTS, RANK] (runs of ``RANK``
    contiguous elements on both sides; the shapes constexpr, so they load and store 16 bytes at a time)."""
    slot = tl.program_id(1)
    tokens = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    ranks = tl.arange(0, BLOCK_RANK)
    in_batch = tokens < num_tokens
    mine = tl.load(ids_ptr + tokens, mask=in_batch, other=-1) == slot
    row_start = tokens.to(tl.int64)[:, None] * (SLOTS * PARTS * RANK)
    in_rank = (ranks < RANK)[None, :]
    for part in tl.static_range(PARTS):
        values = tl.load(every_ptr + row_start + (slot * PARTS + part) * RANK + ranks[None, :],
                         mask=mine[:, None] & in_rank, other=0.0)
        tl.store(masked_ptr + row_start + (part * SLOTS + slot) * RANK + ranks[None, :], values,
                 mask=in_batch[:, None] & in_rank)
