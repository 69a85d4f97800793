"""The `triton` attention backend on a GPU at real sizes, against a float32 PyTorch reference.

32 query heads over 8 KV heads of 128 dims, requests of up to ~4k tokens on
shuffled pages, bfloat16 caches (float32 for a tight check), and decode
through a captured CUDA graph replayed with new lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from treadle.core.execution.attention import RadixAttention
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.memory.pools import KVCache, ReqToTokenPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
MAX_CONTEXT = 8192
DEVICE = "cuda"
DECODE, EXTEND = ForwardMode.DECODE, ForwardMode.EXTEND


@dataclass
class Batch:
    forward_batch: ForwardBatch
    layer: RadixAttention
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    full_k: list[torch.Tensor]
    full_v: list[torch.Tensor]
    prefix_lens: list[int]


def make_batch(mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int], page_size: int,
               window: int | None, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """Requests on shuffled pages of a NaN-filled cache (a wrong slot read poisons the output)."""
    from treadle.plugins.attention.triton.backend import TritonAttnBackend

    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    bs = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_per_req = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages_per_req) + 8
    pool = ReqToTokenPool(bs + 4, MAX_CONTEXT, DEVICE)
    cache = KVCache(num_pages * page_size, page_size, 1, KV_HEADS, HEAD_DIM, dtype, DEVICE)
    cache.k_buffers[0].fill_(float("nan"))
    cache.v_buffers[0].fill_(float("nan"))
    pages = torch.randperm(num_pages, device=DEVICE, generator=gen) + 1
    pool_rows = torch.randperm(bs + 4, device=DEVICE, generator=gen)[:bs]

    full_k, full_v, new_k, new_v, out_cache_loc, positions = [], [], [], [], [], []
    first_page = 0
    for i in range(bs):
        pos = torch.arange(seq_lens[i], device=DEVICE)
        slots = pages[first_page + pos // page_size] * page_size + pos % page_size
        first_page += pages_per_req[i]
        pool.req_to_token[pool_rows[i], : seq_lens[i]] = slots.to(torch.int32)
        k = torch.randn(seq_lens[i], KV_HEADS, HEAD_DIM, device=DEVICE, generator=gen).to(dtype)
        v = torch.randn(seq_lens[i], KV_HEADS, HEAD_DIM, device=DEVICE, generator=gen).to(dtype)
        cache.k_buffers[0][slots[: prefix_lens[i]]] = k[: prefix_lens[i]]
        cache.v_buffers[0][slots[: prefix_lens[i]]] = v[: prefix_lens[i]]
        full_k.append(k)
        full_v.append(v)
        new_k.append(k[prefix_lens[i]:])
        new_v.append(v[prefix_lens[i]:])
        out_cache_loc.append(slots[prefix_lens[i]:])
        positions.append(pos[prefix_lens[i]:])

    runner = SimpleNamespace(
        device=torch.device(DEVICE), dtype=dtype, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        page_size=page_size, req_to_token_pool=pool, kv_cache=cache, sliding_window=window,
        context_len=MAX_CONTEXT,
    )
    backend = TritonAttnBackend(runner)
    num_tokens = sum(extend_lens)
    extend_lens_t = torch.tensor(extend_lens, device=DEVICE)
    starts = torch.cumsum(extend_lens_t, 0) - extend_lens_t
    extend = mode.is_extend()
    forward_batch = ForwardBatch(
        forward_mode=mode, batch_size=bs,
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE),
        positions=torch.cat(positions), req_pool_indices=pool_rows,
        seq_lens=torch.tensor(seq_lens, device=DEVICE), seq_lens_cpu=torch.tensor(seq_lens),
        out_cache_loc=torch.cat(out_cache_loc), seq_lens_sum=sum(seq_lens),
        logits_indices=starts + extend_lens_t - 1,
        req_to_token_pool=pool, kv_cache=cache, attn_backend=backend,
        extend_seq_lens=extend_lens_t if extend else None,
        extend_prefix_lens=torch.tensor(prefix_lens, device=DEVICE) if extend else None,
        extend_start_loc=starts if extend else None,
        extend_seq_lens_cpu=list(extend_lens) if extend else None,
        extend_prefix_lens_cpu=list(prefix_lens) if extend else None,
    )
    q = torch.randn(num_tokens, HEADS * HEAD_DIM, device=DEVICE, generator=gen).to(dtype)
    layer = RadixAttention(HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, 0, sliding_window_size=window)
    batch = Batch(forward_batch, layer, q, torch.cat(new_k).flatten(1), torch.cat(new_v).flatten(1),
                  full_k, full_v, list(prefix_lens))
    return batch, backend


def reference_attention(batch: Batch) -> torch.Tensor:
    group = HEADS // KV_HEADS
    window = batch.layer.sliding_window_size
    q = batch.q.float().view(-1, HEADS, HEAD_DIM)
    outputs, start = [], 0
    for prefix, k, v in zip(batch.prefix_lens, batch.full_k, batch.full_v):
        seq = k.shape[0]
        q_req = q[start : start + seq - prefix].transpose(0, 1)
        start += seq - prefix
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = torch.arange(prefix, seq, device=DEVICE)[:, None]
        k_pos = torch.arange(seq, device=DEVICE)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = (q_req @ k.transpose(1, 2)) * batch.layer.scaling
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outputs.append((probs @ v).transpose(0, 1))
    return torch.cat(outputs).flatten(1)


def run_backend(batch: Batch, backend) -> torch.Tensor:
    backend.init_forward_metadata(batch.forward_batch)
    return batch.layer(batch.q, batch.k, batch.v, batch.forward_batch)


def assert_close(batch: Batch, out: torch.Tensor, tol: float) -> None:
    error = (out.float() - reference_attention(batch)).abs().max().item()
    assert error <= tol, f"max abs error {error} > {tol}"


DECODE_LENS = [1, 17, 300, 1024, 2049, 3000, 4096, 4000]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [None, 1024])
def test_decode_bf16(page_size: int, window: int | None) -> None:
    batch, backend = make_batch(DECODE, [n - 1 for n in DECODE_LENS], [1] * len(DECODE_LENS), page_size, window)
    assert_close(batch, run_backend(batch, backend), 2e-2)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [None, 1024])
def test_extend_with_prefix_bf16(page_size: int, window: int | None) -> None:
    batch, backend = make_batch(EXTEND, [0, 1024, 3000, 100], [2048, 512, 1, 1500], page_size, window)
    assert_close(batch, run_backend(batch, backend), 2e-2)


@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_chains_through_the_decode_kernel_bf16(page_size: int) -> None:
    """A verify step of draft chains (5 tokens each, 8 requests) through the decode kernel, a row per token (the
    cap verify_decode_max_tokens raised to 40); the same step through the extend kernel (the cap at 0)."""
    prefix = [0, 17, 300, 1024, 2049, 3000, 4000, 511]
    for cap in (40, 0):
        batch, backend = make_batch(ForwardMode.TARGET_VERIFY, prefix, [5] * len(prefix), page_size, None)
        backend.verify_decode_max_tokens = cap
        assert_close(batch, run_backend(batch, backend), 2e-2)
        assert backend.forward_metadata.verify_by_decode == (cap == 40)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_decode_and_extend_other_dtypes(dtype: torch.dtype) -> None:
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    batch, backend = make_batch(DECODE, [n - 1 for n in DECODE_LENS], [1] * len(DECODE_LENS), 16, None, dtype)
    assert_close(batch, run_backend(batch, backend), tol)
    batch, backend = make_batch(EXTEND, [0, 512, 2000], [1500, 700, 1], 16, None, dtype)
    assert_close(batch, run_backend(batch, backend), tol)


def test_decode_cuda_graph_replays_with_new_lengths() -> None:
    lens = [2000, 4096, 33, 1500]
    batch, backend = make_batch(DECODE, [n - 1 for n in lens], [1] * len(lens), 16, None)
    fb = batch.forward_batch
    backend.init_cuda_graph_state(max_bs=8, max_num_tokens=8)
    backend.init_forward_metadata_capture_cuda_graph(4, 4, fb.req_pool_indices, fb.seq_lens, DECODE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        batch.layer(batch.q, batch.k, batch.v, fb)  # warm-up compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = batch.layer(batch.q, batch.k, batch.v, fb)
    graph.replay()
    assert_close(batch, static_out, 2e-2)

    # New, shorter lengths written into the same static tensors; the replay must follow them.
    new_lens = [17, 4000, 1, 1024]
    fb.seq_lens.copy_(torch.tensor(new_lens, device=DEVICE))
    rows = fb.req_pool_indices
    fb.out_cache_loc.copy_(fb.req_to_token_pool.req_to_token[rows, fb.seq_lens - 1].long())
    batch.full_k = [k[:n] for k, n in zip(batch.full_k, new_lens)]
    batch.full_v = [v[:n] for v, n in zip(batch.full_v, new_lens)]
    batch.prefix_lens = [n - 1 for n in new_lens]
    batch.k.copy_(torch.stack([k[-1] for k in batch.full_k]).flatten(1))
    batch.v.copy_(torch.stack([v[-1] for v in batch.full_v]).flatten(1))
    backend.init_forward_metadata_replay_cuda_graph(4, rows, fb.seq_lens, sum(new_lens), DECODE)
    graph.replay()
    assert_close(batch, static_out, 2e-2)
    assert torch.equal(static_out, run_backend(batch, backend)), "graph replay and eager decode differ"
