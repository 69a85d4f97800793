"""Split-KV ("flash decoding") attention for one new token per request, in one kernel.

Each request's visible keys are split into chunks of at least ``min_split_tokens``,
at most ``max_kv_splits`` of them, and no more than a large batch needs to fill the
GPU (``target_programs``: on an H100 a batch of 32 requests read its KV 1.2x faster
in one chunk per request than in five, docs/lab/benchmarks-history.md); one program handles
(request, KV head, chunk) for every query head that shares that
KV head (GQA), reading KV slots through ``req_to_token``. A request with one
chunk writes its output directly. Otherwise each program stores a partial output
(normalised by its own softmax sum) and that sum's log (base 2), then counts
itself in on a per-(request, KV head) counter; the last of the request's programs
to arrive combines the partials and resets the counter. So no second kernel is
launched: at one request a decode step had 32 combine launches, ~2 µs each.

The program whose chunk holds a request's new token can also store the step's new K/V
into the cache before it reads it (``k_new``/``v_new``): one kernel per layer less. Given
the rotary embedding's ``cos``/``sin``, the kernel also rotates q and the new k as it loads
them (rounded as the separate rotary kernel rounds): another kernel per layer less.

The launch grid depends only on the batch size and the chunk cap; how many
chunks a request really uses is computed inside the kernel from its length, so a
CUDA graph captured for a batch size replays for any lengths. Programs past a
request's chunk count exit after their first loads: a batch of short requests
pays for its chunks, not for the cap.

At one request the kernel is a chain of dependent loads (the length, the
request's row of ``req_to_token``, the slots, K and V, the partials). Where it
stores the new K/V itself, everything up to the chunk's first block of cached
K/V was written before the step, so it is loaded first, and on Hopper the kernel
is launched with programmatic dependent launch (``kernels/pdl.py``): those loads run
while the q/k/v matmul before it finishes, and the kernel waits for it only
before it reads q and the new K/V (the new token's slot in that first block is
patched in registers). Each block's V is loaded with its K.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treadle.kernels.kv_store import saturate_to_fp8
from treadle.kernels.pdl import wait_for_previous
from treadle.kernels.pdl import enabled as pdl_enabled

_LOG2E = 1.4426950408889634


@triton.jit
def _num_splits(seq_len, window, max_splits, MIN_SPLIT_TOKENS: tl.constexpr):
    """(first visible key, visible keys, chunks) of a request whose new token is at ``seq_len - 1``."""
    # It sees keys j > seq_len - 1 - window.
    kv_begin = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    visible = tl.maximum(seq_len - kv_begin, 1)
    return kv_begin, visible, tl.minimum(tl.cdiv(visible, MIN_SPLIT_TOKENS), max_splits)


@triton.jit
def _decode_kernel(
    Q, K_new, V_new, New_loc, K_cache, V_cache, Req_to_token, Req_pool_indices, Seq_lens,
    Mid_o, Mid_lse, Arrivals, O, Cos, Sin,
    qk_scale, k_scale, v_scale, fp8_max, window,
    stride_q_tok, stride_q_head, stride_cos,
    stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head,
    stride_k_slot, stride_k_head,
    stride_v_slot, stride_v_head,
    stride_req,
    stride_mo_req, stride_mo_head, stride_mo_split,
    stride_ml_req, stride_ml_head,
    stride_o_tok, stride_o_head,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_SPLIT_TOKENS: tl.constexpr,
    PRECISION: tl.constexpr, KV_FP8: tl.constexpr, STORE_KV: tl.constexpr, ROTARY: tl.constexpr,
    PDL: tl.constexpr, TOKENS_PER_REQ: tl.constexpr,
):
    # One query token per program row: ``req`` indexes the tokens (q, out, the new K/V, the partials); with
    # TOKENS_PER_REQ = t > 1 (a verify step) token ``req`` is new token ``req % t`` of request ``req // t``, whose
    # length and table row it reads, and it sees the keys up to its own position (the causal mask among the step's
    # tokens).
    req = tl.program_id(0)
    owner = req // TOKENS_PER_REQ
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The request's length, row of req_to_token and cached keys were written before this step's kernels, so they
    # are read before waiting for the kernel before (kernels/pdl.py): at one request the kernel is a chain of
    # dependent loads, ~1 us each, and this takes the chain off the step's critical path.
    seq_len = tl.load(Seq_lens + owner).to(tl.int32) - (TOKENS_PER_REQ - 1 - req % TOKENS_PER_REQ)
    pool_row = tl.load(Req_pool_indices + owner).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    # The grid's third dimension is the chunk cap.
    kv_begin, visible, num_splits = _num_splits(seq_len, window, tl.num_programs(2), MIN_SPLIT_TOKENS)
    # Chunks are whole blocks of BLOCK_N keys, so the last ones may be empty.
    split_len = tl.cdiv(tl.cdiv(visible, num_splits), BLOCK_N) * BLOCK_N
    start = kv_begin + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    first_pos = start + tl.arange(0, BLOCK_N)
    if STORE_KV:
        # The chunk's first block, but for the new token's slot, which this kernel writes (patched in below).
        first_end = tl.where(split < num_splits, end, start)  # nothing read past the request's chunks
        first_k, first_v = cached_kv_block(K_cache, V_cache, Req_to_token, pool_row, first_pos,
                                           first_pos < first_end, stride_k_slot, stride_k_head, stride_v_slot,
                                           stride_v_head, stride_req, kv_head, offs_d, d_mask)
    else:  # the new token's K/V is in the cache, written by a kernel before: nothing read early
        first_k, first_v = Q, Q
    wait_for_previous(PDL)

    heads = kv_head * GROUP + offs_h
    q_ptrs = Q + req.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head
    q_mask = head_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptrs + offs_d[None, :], mask=q_mask, other=0.0)
    if ROTARY:
        q = _rotated(q, q_ptrs, Cos + req.to(tl.int64) * stride_cos, Sin + req.to(tl.int64) * stride_cos,
                     offs_d[None, :], q_mask, HEAD_DIM)
    if STORE_KV:
        new_slot, new_k, new_v = _new_kv(K_new, V_new, New_loc, K_cache, V_cache, Cos, Sin, k_scale, v_scale,
                                         fp8_max, stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head,
                                         stride_cos, req, kv_head, offs_d, d_mask, HEAD_DIM, KV_FP8, ROTARY)
    if split < num_splits:  # past the request's chunks: nothing to do, and nothing reads it
        if STORE_KV:
            if (start < seq_len) & (end >= seq_len):  # the chunk that reads the new token's slot
                tl.store(K_cache + new_slot * stride_k_slot + kv_head * stride_k_head + offs_d, new_k, mask=d_mask)
                tl.store(V_cache + new_slot * stride_v_slot + kv_head * stride_v_head + offs_d, new_v, mask=d_mask)
                tl.debug_barrier()  # the whole program sees the stored slot before reading it
            is_new = (first_pos == seq_len - 1)[:, None] & d_mask[None, :]
            first_k = tl.where(is_new, new_k[None, :], first_k)
            first_v = tl.where(is_new, new_v[None, :], first_v)
        out, lse = _decode_chunk(q, first_k, first_v, K_cache, V_cache, Req_to_token, pool_row, qk_scale, v_scale,
                                 stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_req,
                                 kv_head, start, end, offs_d, d_mask, BLOCK_H, BLOCK_D, BLOCK_N, PRECISION, KV_FP8,
                                 STORE_KV)
        o_ptrs = O + req.to(tl.int64) * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
        if num_splits == 1:
            tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=q_mask)
        else:
            mo_ptrs = Mid_o + req * stride_mo_req + heads[:, None] * stride_mo_head + offs_d[None, :]
            ml_ptrs = Mid_lse + req * stride_ml_req + heads * stride_ml_head
            tl.store(mo_ptrs + split * stride_mo_split, out, mask=q_mask)
            tl.store(ml_ptrs + split, lse, mask=head_mask)
            tl.debug_barrier()  # every thread's partial is stored before the count releases them
            arrival = Arrivals + req * tl.num_programs(1) + kv_head
            # The release/acquire of the count makes the other chunks' partials visible to the last one.
            if tl.atomic_add(arrival, 1, sem="acq_rel") == num_splits - 1:
                combined = _combine(mo_ptrs, ml_ptrs, num_splits, stride_mo_split, head_mask, q_mask,
                                    BLOCK_H, BLOCK_D)
                tl.atomic_xchg(arrival, 0, sem="relaxed")
                tl.store(o_ptrs, combined.to(O.dtype.element_ty), mask=q_mask)


@triton.jit
def cached_kv_block(K_cache, V_cache, Req_to_token, pool_row, pos, pos_mask, stride_k_slot, stride_k_head,
                    stride_v_slot, stride_v_head, stride_req, kv_head, offs_d, d_mask):
    """Cached K and V ``[BLOCK_N, BLOCK_D]`` of one request's positions ``pos`` (row ``pool_row`` of
    ``Req_to_token``; zeros where masked) for one KV head (the extend kernel reads its cached prefix with it too)."""
    slots = tl.load(Req_to_token + pool_row * stride_req + pos, mask=pos_mask, other=0).to(tl.int64)
    kv_mask = pos_mask[:, None] & d_mask[None, :]
    k = tl.load(K_cache + slots[:, None] * stride_k_slot + kv_head * stride_k_head + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V_cache + slots[:, None] * stride_v_slot + kv_head * stride_v_head + offs_d[None, :],
                mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _rotated(x, x_ptrs, cos_row, sin_row, offs_d, mask, HEAD_DIM: tl.constexpr):
    """``x``, loaded from ``x_ptrs + offs_d`` (head features along the last axis), with HF's rotary embedding
    (``x * cos + rotate_half(x) * sin``) applied, each product and the sum rounded to x's dtype as the separate
    rotary kernel (``fused_ops.rotary_qkv``) rounds them."""
    half = HEAD_DIM // 2
    first = offs_d < half
    partner = tl.load(x_ptrs + tl.where(first, offs_d + half, offs_d - half), mask=mask, other=0.0)
    partner = tl.where(first, -partner.to(tl.float32), partner.to(tl.float32))
    d_mask = offs_d < HEAD_DIM
    cos = tl.load(cos_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    dtype = x.dtype
    return ((x.to(tl.float32) * cos).to(dtype).to(tl.float32) + (partner * sin).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _new_kv(K_new, V_new, New_loc, K_cache, V_cache, Cos, Sin, k_scale, v_scale, fp8_max,
            stride_kn_tok, stride_kn_head, stride_vn_tok, stride_vn_head, stride_cos,
            req, kv_head, offs_d, d_mask, HEAD_DIM: tl.constexpr, KV_FP8: tl.constexpr, ROTARY: tl.constexpr):
    """(cache slot, K, V) of this step's token of one request and KV head, as the cache stores them (an FP8 cache
    holds ``x / scale`` rounded as ``KVCache.set_kv_buffer`` rounds it); ``ROTARY``: K rotated first."""
    slot = tl.load(New_loc + req).to(tl.int64)
    k_ptrs = K_new + req.to(tl.int64) * stride_kn_tok + kv_head * stride_kn_head
    k = tl.load(k_ptrs + offs_d, mask=d_mask)
    if ROTARY:
        k = _rotated(k, k_ptrs, Cos + req.to(tl.int64) * stride_cos, Sin + req.to(tl.int64) * stride_cos, offs_d,
                     d_mask, HEAD_DIM)
    v = tl.load(V_new + req.to(tl.int64) * stride_vn_tok + kv_head * stride_vn_head + offs_d, mask=d_mask)
    if KV_FP8:
        k = saturate_to_fp8(k, k_scale, fp8_max).to(K_cache.dtype.element_ty, fp_downcast_rounding="rtne")
        v = saturate_to_fp8(v, v_scale, fp8_max).to(V_cache.dtype.element_ty, fp_downcast_rounding="rtne")
    return slot, k.to(K_cache.dtype.element_ty), v.to(V_cache.dtype.element_ty)


@triton.jit
def _decode_chunk(
    q, first_k, first_v, K_cache, V_cache, Req_to_token, pool_row, qk_scale, v_scale,
    stride_k_slot, stride_k_head, stride_v_slot, stride_v_head, stride_req,
    kv_head, start, end, offs_d, d_mask,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, HAS_FIRST: tl.constexpr,
):
    """Keys ``[start, end)`` of one request (row ``pool_row`` of ``Req_to_token``) for one KV head and its query
    heads ``q``: the output normalised by its own softmax sum, and that sum's log (base 2; -inf for a chunk without
    keys, whose output is zeros). ``HAS_FIRST``: the first block's K and V are ``first_k`` and ``first_v``."""
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    loop_start = start
    if HAS_FIRST:
        if start < end:  # an empty chunk (past the keys) folds in nothing
            pos = start + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _attend(q, first_k, first_v, pos < end, m_i, l_i, acc, qk_scale, PRECISION, KV_FP8)
        loop_start = start + BLOCK_N
    for block_start in range(loop_start, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        k, v = cached_kv_block(K_cache, V_cache, Req_to_token, pool_row, pos, pos_mask, stride_k_slot, stride_k_head,
                               stride_v_slot, stride_v_head, stride_req, kv_head, offs_d, d_mask)
        m_i, l_i, acc = _attend(q, k, v, pos_mask, m_i, l_i, acc, qk_scale, PRECISION, KV_FP8)

    has_keys = l_i > 0
    out = acc * (v_scale / tl.where(has_keys, l_i, 1.0))[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _attend(q, k, v, pos_mask, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr, KV_FP8: tl.constexpr):
    """One block of keys folded into the running softmax (max ``m_i``, sum ``l_i``) and output ``acc``."""
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
    scores = tl.where(pos_mask[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _combine(mo_ptrs, ml_ptrs, num_splits, stride_mo_split, head_mask, o_mask,
             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """A request's chunks' partial outputs weighted by their softmax sums (chunks without keys weigh 0)."""
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(0, num_splits):
        # .cg: read from L2, where the other programs' stores are, not from a stale L1 line.
        lse = tl.load(ml_ptrs + s, mask=head_mask, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(mo_ptrs + s * stride_mo_split, mask=o_mask, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        # Rows with no keys so far keep -inf; shift them by 0 so that exp2 gives 0, not NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - shift)
        weight = tl.exp2(lse - shift)
        acc = acc * alpha[:, None] + part * weight[:, None]
        total = total * alpha + weight
        m = m_new
    return acc / tl.where(total > 0, total, 1.0)[:, None]


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
    mid_o: torch.Tensor, mid_lse: torch.Tensor, arrivals: torch.Tensor,
    scaling: float,
    sliding_window: int | None,
    max_kv_splits: int,
    min_split_tokens: int,
    block_n: int = 64,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    num_stages: int = 2,
    target_programs: int = 0,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    tokens_per_req: int = 1,
) -> None:
    """Attention of one query token per request over its cached keys, written into ``out``.

    ``tokens_per_req`` t > 1: q holds t tokens of each request (their K/V cached already: no ``new_kv``), each a
    scratch row, token j seeing its request's keys up to its own position (``seq_lens`` counts all t).

    q, out: ``[bs, num_heads, head_dim]``; k_cache, v_cache: ``[num_slots, num_kv_heads, head_dim]``;
    req_to_token: ``[pool_size, max_context]``; mid_o: float32 ``[>=bs, num_heads, max_kv_splits, head_dim]``;
    mid_lse: float32 ``[>=bs, num_heads, max_kv_splits]``; arrivals: int32 zeros, at least
    ``bs * num_kv_heads`` (left zero again). ``new_kv`` = ``(k, v, loc)``, k and v ``[bs, num_kv_heads,
    head_dim]``: the kernel first stores them at slots ``loc``; without it the new token's K/V must already be
    in the cache. A query at position i sees keys j with ``i - sliding_window < j <= i`` (None: all
    ``j <= i``). ``block_n`` keys are read per iteration; a request uses ``min(max_kv_splits, ceil(visible /
    min_split_tokens))`` chunks, fewer where ``target_programs`` (> 0) caps them at ``target_programs // (bs *
    num_kv_heads)`` (at least one): a batch whose requests and KV heads alone fill the GPU reads each request's keys in
    one pass, without partials to store and combine. ``num_stages`` is the launch's software-pipelining depth. An FP8
    cache holds ``k / k_scale`` and ``v / v_scale`` (one scale per layer). ``rotary`` = ``(cos, sin)``, each
    ``[bs, head_dim]`` (HF's ``rotate_half`` layout, q's dtype, unit stride on head_dim): q and the new k (which
    ``new_kv`` must then hold) are not rotated yet, and the kernel applies the embedding as it loads them.
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if bs == 0:
        return
    if arrivals.numel() < bs * num_kv_heads:
        raise ValueError(f"decode_attention needs {bs * num_kv_heads} arrival counters, got {arrivals.numel()}")
    k_new, v_new, new_loc = new_kv if new_kv is not None else (q, q, seq_lens)  # unread placeholders
    if rotary is not None and new_kv is None:
        raise ValueError("decode_attention applies the rotary embedding only with new_kv (the k to rotate)")
    if tokens_per_req > 1 and (new_kv is not None or bs % tokens_per_req):
        raise ValueError(f"{tokens_per_req} tokens per request: no new_kv, and a multiple of them, not {bs} rows")
    cos, sin = rotary if rotary is not None else (q, q)
    kv_fp8 = k_cache.dtype == torch.float8_e4m3fn
    # Launched with PDL (kernels/pdl.py) where the kernel stores the new K/V itself, so that everything it reads
    # before waiting was written before the step.
    pdl = new_kv is not None and pdl_enabled(q.device)
    splits = max_kv_splits
    if target_programs > 0:
        splits = max(1, min(max_kv_splits, target_programs // (bs * num_kv_heads)))
    _decode_kernel[(bs, num_kv_heads, splits)](
        q, k_new, v_new, new_loc, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
        mid_o, mid_lse, arrivals, out, cos, sin,
        scaling * _LOG2E * k_scale, k_scale, v_scale, float(torch.finfo(k_cache.dtype).max) if kv_fp8 else 0.0,
        sliding_window or 0,
        q.stride(0), q.stride(1), cos.stride(0),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_H=max(triton.next_power_of_2(group), 16),
        HEAD_DIM=head_dim, BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        BLOCK_N=block_n, MIN_SPLIT_TOKENS=min_split_tokens,
        PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
        KV_FP8=kv_fp8, STORE_KV=new_kv is not None, ROTARY=rotary is not None, PDL=pdl, launch_pdl=pdl,
        TOKENS_PER_REQ=tokens_per_req,
        num_warps=4, num_stages=num_stages,
    )
