"""torch_native attention equals dense masked attention, for GQA, sliding windows, scattered slots, both save modes.

Requests of different lengths share one padded decode computation; padding must never reach the output.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from treadle.core.execution.attention import RadixAttention
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.memory.pools import KVCache, ReqToTokenPool
from treadle.plugins.attention import torch_native
from treadle.plugins.attention.torch_native import TorchNativeAttnBackend

HEADS, KV_HEADS, DIM = 4, 2, 8


def _dense(q, k, v, prefix_len, window, scale):
    """Attention of the new queries over all keys with explicit float64 math."""
    q, k, v = (t.double() for t in (q, k, v))
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(prefix_len, prefix_len + q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    visible = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("save_kv_cache", [True, False])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
@pytest.mark.parametrize("bucket_padding", [64, 3], ids=["one-decode-bucket", "reordered-decode-buckets"])
def test_matches_dense_attention(window, save_kv_cache, mode, bucket_padding, monkeypatch):
    monkeypatch.setattr(torch_native, "DECODE_BUCKET_MAX_PADDING", bucket_padding)
    torch.manual_seed(0)
    page_size, kv_size = 4, 256
    pool = ReqToTokenPool(4, 64, "cpu")
    cache = KVCache(kv_size, page_size, 1, KV_HEADS, DIM, torch.float32, "cpu")
    # Slots no request owns (padding slot 0 included) hold NaN: reading one, even under a mask, poisons the output.
    for buffer in cache.k_buffers + cache.v_buffers:
        buffer.fill_(float("nan"))
    runner = SimpleNamespace(device="cpu", dtype=torch.float32, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                             page_size=page_size, req_to_token_pool=pool, kv_cache=cache, sliding_window=window,
                             context_len=64)
    backend = TorchNativeAttnBackend(runner)
    layer = RadixAttention(HEADS, DIM, DIM**-0.5, KV_HEADS, layer_id=0, sliding_window_size=window)
    free = (torch.randperm(kv_size) + page_size).tolist()

    prefix_lens = [9, 0, 3]
    new_lens = [1, 1, 1] if mode == ForwardMode.DECODE else [4, 7, 1]
    if mode == ForwardMode.DECODE:
        prefix_lens = [6, 9, 3]  # not longest first, so small buckets reorder the batch
    full_k, full_v, out_cache_loc = [], [], []
    for req, (prefix, new) in enumerate(zip(prefix_lens, new_lens)):
        slots = torch.tensor([free.pop() for _ in range(prefix + new)])
        pool.req_to_token[req, : prefix + new] = slots.int()
        k, v = torch.randn(prefix + new, KV_HEADS, DIM), torch.randn(prefix + new, KV_HEADS, DIM)
        cache.set_kv_buffer(0, slots[:prefix], k[:prefix], v[:prefix])
        full_k.append(k)
        full_v.append(v)
        out_cache_loc.append(slots[prefix:])
    q = torch.randn(sum(new_lens), HEADS * DIM)
    k_new = torch.cat([k[p:] for k, p in zip(full_k, prefix_lens)]).flatten(1)
    v_new = torch.cat([v[p:] for v, p in zip(full_v, prefix_lens)]).flatten(1)
    seq_lens = torch.tensor([p + n for p, n in zip(prefix_lens, new_lens)])
    extend = {}
    if mode == ForwardMode.EXTEND:
        extend = dict(extend_seq_lens=torch.tensor(new_lens), extend_prefix_lens=torch.tensor(prefix_lens),
                      extend_start_loc=torch.tensor([0, 4, 11]), extend_seq_lens_cpu=new_lens,
                      extend_prefix_lens_cpu=prefix_lens)
    batch = ForwardBatch(mode, 3, torch.zeros(len(q), dtype=torch.long), torch.zeros(len(q), dtype=torch.long),
                         torch.arange(3), seq_lens, seq_lens.clone(), torch.cat(out_cache_loc), int(seq_lens.sum()),
                         torch.arange(len(q)), pool, cache, backend, **extend)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k_new, v_new, layer, batch, save_kv_cache=save_kv_cache)

    start = 0
    for k, v, prefix, new in zip(full_k, full_v, prefix_lens, new_lens):
        expected = _dense(q[start : start + new].view(new, HEADS, DIM), k, v, prefix, window, DIM**-0.5)
        torch.testing.assert_close(out[start : start + new].view(new, HEADS, DIM), expected, atol=1e-5, rtol=1e-5)
        start += new
    written = cache.get_key_buffer(0)[torch.cat(out_cache_loc)]
    assert torch.equal(written, k_new.view(-1, KV_HEADS, DIM)) == save_kv_cache
