"""Split-KV ("flash decoding") attention for one new token per request.

Stage 1 splits each request's visible keys into up to ``max_kv_splits`` chunks;
one program handles (request, KV head, chunk) for every query head that shares
that KV head (GQA), reading KV slots through ``req_to_token``, and writes a
partial output normalised by its own softmax sum plus that sum's log
(base 2). Stage 2 combines a request's partials per query head.

The launch grid depends only on the batch size and ``max_kv_splits``; how many
chunks a request really uses is computed inside both kernels from its length, so
a CUDA graph captured for a batch size replays for any lengths. Programs past a
request's chunk count exit at once and stage 2 reads only the chunks used: a
batch of short requests pays for its chunks, not for ``max_kv_splits``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _num_splits(seq_len, window, MAX_SPLITS: tl.constexpr, MIN_SPLIT_TOKENS: tl.constexpr):
    """(first visible key, visible keys, chunks) of a request whose new token is at ``seq_len - 1``."""
    # It sees keys j > seq_len - 1 - window.
    kv_begin = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    visible = tl.maximum(seq_len - kv_begin, 1)
    return kv_begin, visible, tl.minimum(tl.cdiv(visible, MIN_SPLIT_TOKENS), MAX_SPLITS)


@triton.jit
def _decode_partial_kernel(
    Q, K_cache, V_cache, Req_to_token, Req_pool_indices, Seq_lens,
    Mid_o, Mid_lse,
    qk_scale, v_scale, window,
    stride_q_tok, stride_q_head,
    stride_k_slot, stride_k_head,
    stride_v_slot, stride_v_head,
    stride_req,
    stride_mo_req, stride_mo_head, stride_mo_split,
    stride_ml_req, stride_ml_head,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, MIN_SPLIT_TOKENS: tl.constexpr,
    PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(Seq_lens + req).to(tl.int32)
    kv_begin, visible, num_splits = _num_splits(seq_len, window, MAX_SPLITS, MIN_SPLIT_TOKENS)
    if split < num_splits:  # past the request's chunks: nothing to do, and stage 2 does not read it
        _decode_partial(Q, K_cache, V_cache, Req_to_token, Req_pool_indices, Mid_o, Mid_lse, qk_scale, v_scale,
                        stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                        stride_req, stride_mo_req, stride_mo_head, stride_mo_split, stride_ml_req, stride_ml_head,
                        req, kv_head, split, seq_len, kv_begin, visible, num_splits,
                        GROUP, BLOCK_H, HEAD_DIM, BLOCK_D, BLOCK_N, PRECISION, KV_FP8)


@triton.jit
def _decode_partial(
    Q, K_cache, V_cache, Req_to_token, Req_pool_indices, Mid_o, Mid_lse, qk_scale, v_scale,
    stride_q_tok, stride_q_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
    stride_req, stride_mo_req, stride_mo_head, stride_mo_split, stride_ml_req, stride_ml_head,
    req, kv_head, split, seq_len, kv_begin, visible, num_splits,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    """One chunk of one request for one KV head: its partial output and log-sum-exp (base 2)."""
    pool_row = tl.load(Req_pool_indices + req).to(tl.int64)
    split_len = tl.cdiv(tl.cdiv(visible, num_splits), BLOCK_N) * BLOCK_N
    start = kv_begin + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h

    q = tl.load(
        Q + req.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=head_mask[:, None] & d_mask[None, :], other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    for block_start in range(start, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        slots = tl.load(Req_to_token + pool_row * stride_req + pos, mask=pos_mask, other=0).to(tl.int64)
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k = tl.load(K_cache + slots[:, None] * stride_k_slot + kv_head * stride_k_head + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
        scores = tl.where(pos_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V_cache + slots[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # An empty chunk (start >= end) stores zeros with lse -inf: weight 0 in stage 2.
    has_keys = l_i > 0
    out = acc * (v_scale / tl.where(has_keys, l_i, 1.0))[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(
        Mid_o + req * stride_mo_req + heads[:, None] * stride_mo_head + split * stride_mo_split + offs_d[None, :],
        out, mask=head_mask[:, None] & d_mask[None, :],
    )
    tl.store(Mid_lse + req * stride_ml_req + heads * stride_ml_head + split, lse, mask=head_mask)


@triton.jit
def _decode_combine_kernel(
    Mid_o, Mid_lse, O, Seq_lens, window,
    stride_mo_req, stride_mo_head, stride_mo_split,
    stride_ml_req, stride_ml_head,
    stride_o_tok, stride_o_head,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MAX_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, MIN_SPLIT_TOKENS: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(Seq_lens + req).to(tl.int32)
    _, _, num_splits = _num_splits(seq_len, window, MAX_SPLITS, MIN_SPLIT_TOKENS)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits  # stage 1 wrote only these
    d_mask = offs_d < HEAD_DIM

    lse = tl.load(Mid_lse + req * stride_ml_req + head * stride_ml_head + offs_s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # Guards only padding rows with no keys at all (seq_len 0): they produce zeros, not NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    partial = tl.load(
        Mid_o + req * stride_mo_req + head * stride_mo_head + offs_s[:, None] * stride_mo_split + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :], other=0.0,
    )
    total = tl.sum(weights, 0)
    out = tl.sum(partial * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(O + req.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d,
             out.to(O.dtype.element_ty), mask=d_mask)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    scaling: float,
    sliding_window: int | None,
    max_kv_splits: int,
    min_split_tokens: int,
    block_n: int = 64,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Attention of one query token per request over its cached keys, written into ``out``.

    q, out: ``[bs, num_heads, head_dim]``; k_cache, v_cache: ``[num_slots, num_kv_heads, head_dim]``
    (the new token's K/V must already be stored); req_to_token: ``[pool_size, max_context]``;
    mid_o: float32 ``[>=bs, num_heads, max_kv_splits, head_dim]``; mid_lse: float32
    ``[>=bs, num_heads, max_kv_splits]``. A query at position i sees keys j with
    ``i - sliding_window < j <= i`` (None: all ``j <= i``). ``block_n`` keys are read per
    iteration; a request uses ``min(max_kv_splits, ceil(visible / min_split_tokens))`` chunks.
    An FP8 cache holds ``k / k_scale`` and ``v / v_scale`` (one scale per layer).
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_d = max(triton.next_power_of_2(head_dim), 16)
    if bs == 0:
        return
    _decode_partial_kernel[(bs, num_kv_heads, max_kv_splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
        mid_o, mid_lse,
        scaling * _LOG2E * k_scale, v_scale, sliding_window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, BLOCK_H=max(triton.next_power_of_2(group), 16),
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=block_n, MAX_SPLITS=max_kv_splits, MIN_SPLIT_TOKENS=min_split_tokens,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        KV_FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=4, num_stages=2,
    )
    _decode_combine_kernel[(bs, num_heads)](
        mid_o, mid_lse, out, seq_lens, sliding_window or 0,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        MAX_SPLITS=max_kv_splits, BLOCK_S=triton.next_power_of_2(max_kv_splits), MIN_SPLIT_TOKENS=min_split_tokens,
        num_warps=4 if block_d <= 128 else 8,
    )
