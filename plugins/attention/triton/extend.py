"""Attention for new tokens (prefill, chunked prefill, mixed batches) over a cached prefix.

One program handles a block of one request's new tokens for one query head,
with FlashAttention's online softmax over two key ranges: (a) the cached
prefix, read slot by slot through ``req_to_token``, and (b) the new tokens
themselves, read from the contiguous k, v of this step, under a causal mask.
Query heads index their KV head as ``head // (num_heads // num_kv_heads)`` (GQA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treadle.plugins.attention.triton.decode import cached_kv_block

_LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(scores, mask, m_i, l_i, acc, v, PRECISION: tl.constexpr):
    scores = tl.where(mask, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row with no visible key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(scores - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    Q, K_new, V_new, O, K_cache, V_cache, Req_to_token,
    Req_pool_indices, Extend_start_loc, Extend_seq_lens, Extend_prefix_lens, Tree_mask, Positions,
    qk_scale, k_scale, v_scale, window,
    stride_q_tok, stride_q_head,
    stride_kn_tok, stride_kn_head,
    stride_vn_tok, stride_vn_head,
    stride_o_tok, stride_o_head,
    stride_k_slot, stride_k_head,
    stride_v_slot, stride_v_head,
    stride_req,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, KV_FP8: tl.constexpr, TREE: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    block_m = tl.program_id(2)

    extend_len = tl.load(Extend_seq_lens + req).to(tl.int32)
    if block_m * BLOCK_M < extend_len:
        prefix_len = tl.load(Extend_prefix_lens + req).to(tl.int32)
        first_tok = tl.load(Extend_start_loc + req).to(tl.int64)
        pool_row = tl.load(Req_pool_indices + req).to(tl.int64)
        kv_head = head // GROUP

        offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)  # index among the new tokens
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < extend_len
        d_mask = offs_d < HEAD_DIM
        if TREE:  # a tree verify step: a node's position is its depth past the prefix
            q_pos = tl.load(Positions + first_tok + offs_m, mask=m_mask, other=0).to(tl.int32)
        else:
            q_pos = prefix_len + offs_m  # absolute position of each query
        # Each query sees keys at absolute positions > key_floor (-1: no window).
        key_floor = tl.where(window > 0, q_pos - window, -1)
        q = tl.load(
            Q + (first_tok + offs_m)[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :], other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # The block's earliest query sits at prefix_len + block_m * BLOCK_M; nothing before its
        # window start is visible to any query of the block.
        lowest_visible = tl.where(window > 0, tl.maximum(prefix_len + block_m * BLOCK_M - window + 1, 0), 0)

        # (a) cached prefix: positions [lowest_visible, prefix_len), all earlier than every query.
        for block_start in range(lowest_visible, prefix_len, BLOCK_N):
            pos = block_start + tl.arange(0, BLOCK_N)
            pos_mask = pos < prefix_len
            k, v = cached_kv_block(K_cache, V_cache, Req_to_token, pool_row, pos, pos_mask, stride_k_slot,
                                   stride_k_head, stride_v_slot, stride_v_head, stride_req, kv_head, offs_d, d_mask)
            if KV_FP8:  # the cache holds k / k_scale, v / v_scale
                v = (v.to(tl.float32) * v_scale).to(q.dtype)
                scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * (qk_scale * k_scale)
            else:
                scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
            visible = pos_mask[None, :] & (pos[None, :] > key_floor[:, None])
            m_i, l_i, acc = _online_softmax_step(scores, visible, m_i, l_i, acc, v, PRECISION)

        # (b) new tokens, causal: keys up to the block's last query.
        new_begin = tl.maximum(lowest_visible - prefix_len, 0)
        new_end = tl.minimum((block_m + 1) * BLOCK_M, extend_len)
        for block_start in range(new_begin, new_end, BLOCK_N):
            offs_n = block_start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < new_end
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(K_new + (first_tok + offs_n)[:, None] * stride_kn_tok + kv_head * stride_kn_head
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V_new + (first_tok + offs_n)[:, None] * stride_vn_tok + kv_head * stride_vn_head
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
            if TREE:  # Tree_mask [bs, t, t]: a node sees its ancestors and itself (t = extend_len)
                seen = tl.load(Tree_mask + (req * extend_len + offs_m[:, None]) * extend_len + offs_n[None, :],
                               mask=m_mask[:, None] & n_mask[None, :], other=0)
                key_pos = tl.load(Positions + first_tok + offs_n, mask=n_mask, other=0).to(tl.int32)
                visible = n_mask[None, :] & (seen != 0) & (key_pos[None, :] > key_floor[:, None])
            else:
                visible = (n_mask[None, :] & (offs_n[None, :] <= offs_m[:, None])
                           & (prefix_len + offs_n[None, :] > key_floor[:, None]))
            m_i, l_i, acc = _online_softmax_step(scores, visible, m_i, l_i, acc, v, PRECISION)

        # Every real query sees at least itself, so l_i > 0 on rows that are stored.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            O + (first_tok + offs_m)[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :],
            out.to(O.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :],
        )


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    max_extend_len: int,
    scaling: float,
    sliding_window: int | None,
    block_m: int | None = None,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tree_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> None:
    """Attention of every new token over its request's prefix and earlier new tokens, into ``out``.

    q, out: ``[num_tokens, num_heads, head_dim]``; k, v: ``[num_tokens, num_kv_heads, head_dim]``
    (this step's new tokens, flattened by request); k_cache, v_cache: ``[num_slots, num_kv_heads,
    head_dim]`` holding each request's first ``extend_prefix_lens[i]`` tokens at
    ``req_to_token[req_pool_indices[i], :prefix]``. ``max_extend_len`` (a host int, at least
    every ``extend_seq_lens[i]``) sizes the grid. A query at position i sees keys j with
    ``i - sliding_window < j <= i`` (None: all ``j <= i``). An FP8 cache holds ``k / k_scale`` and
    ``v / v_scale``; this step's k, v are used as given.

    ``tree_mask`` (``[bs, t, t]`` bool, every request ``t`` new tokens) and ``positions`` (``[num_tokens]``): a
    verify step over draft trees, where new token ``a`` sees new token ``b`` only where ``tree_mask[i, a, b]`` and
    sits at ``positions[a]`` (for the sliding window).
    """
    bs = int(req_pool_indices.shape[0])
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    if bs == 0 or max_extend_len == 0:
        return
    default_m, default_n, num_warps, num_stages = _launch_config(head_dim, k_cache.dtype)
    block_m = block_m or default_m
    block_n = block_n or default_n
    grid = (bs, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k, v, out, k_cache, v_cache, req_to_token,
        req_pool_indices, extend_start_loc, extend_seq_lens, extend_prefix_lens,
        tree_mask.to(torch.uint8) if tree_mask is not None else extend_seq_lens,
        positions if positions is not None else extend_seq_lens,
        scaling * _LOG2E, k_scale, v_scale, sliding_window or 0,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        TREE=tree_mask is not None,
        num_warps=num_warps, num_stages=num_stages,
    )


def _launch_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) that fit shared memory for this head size and dtype."""
    if dtype == torch.float32 or head_dim > 128:
        return 64, 32, 4, 2
    # Best of a sweep on an H100 (bf16, head_dim 128): ~258 TFLOP/s on a 4k causal prefill.
    return 64, 64, 4, 3
