"""The `torch_native` attention backend: plain PyTorch SDPA over KV gathered through ``req_to_token``.

It is the reference the other backends are checked against, so it stays
obvious: each request's K/V are gathered through
``req_to_token[req_pool_idx, :seq_len]`` (which makes any page size
transparent) and attended with ``scaled_dot_product_attention`` under an
explicit causal / sliding-window mask. Index tensors and masks are built once
per step in ``init_forward_metadata`` and shared by every layer, so a layer is
a handful of tensor ops rather than a Python loop of them:

- decode: requests are grouped by length into a few buckets; a bucket pads its
  requests to its longest one (padding is masked out), and a layer does one
  gather for the whole batch and one SDPA call per bucket;
- extend: one gather for the whole batch, then one SDPA call per request
  (padding queries of different lengths measured slower than the loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from treadle.core.execution.attention import AttentionBackend, RadixAttention, head_layout
from treadle.core.execution.attention_context import AttentionContext
from treadle.core.execution.forward_batch import ForwardBatch
from treadle.core.hookspecs import Register, hookimpl

# A decode request starts a new bucket when padding it to its bucket's longest request
# would add more key rows than this. One more bucket costs one SDPA call (tens of
# microseconds on a CPU core), about what attending this many padded rows costs.
DECODE_BUCKET_MAX_PADDING = 64


class TorchNativeAttnBackend(AttentionBackend):
    """Reference attention over the paged KV cache: GQA, sliding windows, any page size, runs on any device.

    Computes in the KV cache's dtype (float32 caches give float32 attention).
    """

    supports_cuda_graph = False
    supports_tree_mask = True  # TARGET_VERIFY steps over draft trees (ForwardBatch.tree_mask)

    @classmethod
    def auto_priority(cls, device: torch.device) -> int | None:
        return 0  # runs anywhere: the CPU's choice, and the GPU's last resort

    def __init__(self, context: AttentionContext) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = head_layout(context, "torch_native")
        if getattr(context.kv_cache, "is_fp8", False):
            raise ValueError(
                "torch_native attention does not read FP8 KV caches; use attention.backend: triton or "
                "flashinfer with cache.kv_dtype: fp8_e4m3, or cache.kv_dtype: auto"
            )
        self.device = torch.device(context.device)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        forward_batch.attn_metadata = _step_index(forward_batch)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        index = _current_index(forward_batch, _ExtendIndex)
        keys, values = _gather_kv(k, v, layer, forward_batch, index.kv_slots, index.new_kv_rows, save_kv_cache)
        compute_dtype, out_dtype = keys.dtype, q.dtype
        q = q.view(-1, layer.num_heads, layer.head_dim).to(compute_dtype)
        masks = index.masks(layer.sliding_window_size)
        out = torch.empty_like(q)
        for i in range(len(index.seq_lens)):
            q_start, new_len = index.token_starts[i], index.new_lens[i]
            kv_start, seq_len = index.kv_starts[i], index.seq_lens[i]
            attended = F.scaled_dot_product_attention(
                q[q_start : q_start + new_len].transpose(0, 1),
                keys[kv_start : kv_start + seq_len].transpose(0, 1),
                values[kv_start : kv_start + seq_len].transpose(0, 1),
                attn_mask=masks[i],
                scale=layer.scaling,
                enable_gqa=layer.num_heads != layer.num_kv_heads,
            )
            out[q_start : q_start + new_len] = attended.transpose(0, 1)
        return out.view(-1, layer.num_heads * layer.head_dim).to(out_dtype)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        index = _current_index(forward_batch, _DecodeIndex)
        keys, values = _gather_kv(k, v, layer, forward_batch, index.kv_slots, index.new_kv_rows, save_kv_cache)
        compute_dtype, out_dtype = keys.dtype, q.dtype
        num_kv_heads, head_dim = layer.num_kv_heads, layer.head_dim
        bs = len(index.seq_lens)
        # A request's `group` query heads share one KV head, so they are `group` queries
        # of one attention problem: GQA without copying K/V.
        q = q.view(bs, num_kv_heads, layer.num_heads // num_kv_heads, head_dim).to(compute_dtype)
        if index.order is not None:
            q = q.index_select(0, index.order)
        attended = []
        for bucket, mask in zip(index.buckets, index.masks(layer.sliding_window_size)):
            rows = slice(bucket.kv_start, bucket.kv_start + bucket.num_reqs * bucket.max_seq_len)
            padded_shape = (bucket.num_reqs, bucket.max_seq_len, num_kv_heads, head_dim)
            attended.append(F.scaled_dot_product_attention(
                q[bucket.first_req : bucket.first_req + bucket.num_reqs],
                keys[rows].view(padded_shape).transpose(1, 2),
                values[rows].view(padded_shape).transpose(1, 2),
                attn_mask=mask,
                scale=layer.scaling,
            ))
        out = attended[0] if len(attended) == 1 else torch.cat(attended)
        if index.restore is not None:
            out = out.index_select(0, index.restore)
        return out.reshape(bs, layer.num_heads * head_dim).to(out_dtype)


@dataclass
class _Bucket:
    """Decode requests ``first_req : first_req + num_reqs`` (bucket order), each padded to ``max_seq_len`` keys
    at gathered rows ``kv_start : kv_start + num_reqs * max_seq_len``."""

    first_req: int
    num_reqs: int
    max_seq_len: int
    min_seq_len: int
    kv_start: int


@dataclass
class _DecodeIndex:
    """One decode step's gather index and masks, shared by every layer.

    Requests are reordered longest first (``order``: bucket position -> request; ``restore`` undoes it;
    both None when the batch is one bucket in its own order). ``kv_slots`` lists, bucket after bucket,
    each request's KV slots padded with its first slot. ``new_kv_rows[i]`` is the gathered row of
    request ``i``'s new token (used when K/V are not saved to the cache).
    """

    seq_lens: list[int]  # batch order
    buckets: list[_Bucket]
    order: torch.Tensor | None
    restore: torch.Tensor | None
    kv_slots: torch.Tensor
    new_kv_rows: torch.Tensor
    bucket_seq_lens: torch.Tensor  # bucket order, on the device
    _masks: dict[int | None, list[torch.Tensor | None]] = field(default_factory=dict)

    @classmethod
    def of(cls, forward_batch: ForwardBatch) -> "_DecodeIndex":
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        device = req_to_token.device
        seq_lens = [int(n) for n in forward_batch.seq_lens_cpu.tolist()]
        longest_first = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
        buckets = _length_buckets([seq_lens[i] for i in longest_first], DECODE_BUCKET_MAX_PADDING)
        order = longest_first if len(buckets) > 1 else list(range(len(seq_lens)))
        first_rows = [b.kv_start + j * b.max_seq_len for b in buckets for j in range(b.num_reqs)]
        new_kv_rows = [0] * len(seq_lens)
        for position, req in enumerate(order):
            new_kv_rows[req] = first_rows[position] + seq_lens[req] - 1

        pool_indices = forward_batch.req_pool_indices.to(device)
        order_device = restore_device = None
        if len(buckets) > 1:
            order_device = torch.tensor(order, dtype=torch.int64).to(device, non_blocking=True)
            restore_device = torch.tensor(sorted(range(len(order)), key=order.__getitem__)).to(device, non_blocking=True)
            pool_indices = pool_indices.index_select(0, order_device)
        bucket_seq_lens = torch.tensor([seq_lens[i] for i in order], dtype=torch.int64).to(device, non_blocking=True)
        rows = req_to_token[pool_indices, : max(seq_lens, default=0)].long()
        kv_slots = []
        for bucket in buckets:
            reqs = slice(bucket.first_req, bucket.first_req + bucket.num_reqs)
            bucket_rows = rows[reqs, : bucket.max_seq_len]
            in_request = torch.arange(bucket.max_seq_len, device=device)[None, :] < bucket_seq_lens[reqs, None]
            # Padding repeats the request's first slot: it is masked out, and unlike slot 0 it
            # holds finite K/V (a NaN key would poison the softmax even under the mask).
            kv_slots.append(torch.where(in_request, bucket_rows, bucket_rows[:, :1]).flatten())
        return cls(
            seq_lens=seq_lens,
            buckets=buckets,
            order=order_device,
            restore=restore_device,
            kv_slots=torch.cat(kv_slots) if kv_slots else rows.flatten(),
            new_kv_rows=torch.tensor(new_kv_rows, dtype=torch.int64).to(device, non_blocking=True),
            bucket_seq_lens=bucket_seq_lens,
        )

    def masks(self, window: int | None) -> list[torch.Tensor | None]:
        """Per bucket, a boolean ``[num_reqs, 1, 1, max_seq_len]`` (True = attend), None when all keys are seen."""
        if window not in self._masks:
            self._masks[window] = [self._bucket_mask(bucket, window) for bucket in self.buckets]
        return self._masks[window]

    def _bucket_mask(self, bucket: _Bucket, window: int | None) -> torch.Tensor | None:
        lengths = self.bucket_seq_lens[bucket.first_req : bucket.first_req + bucket.num_reqs, None]
        if bucket.min_seq_len == bucket.max_seq_len and (window is None or bucket.max_seq_len <= window):
            return None
        key_pos = torch.arange(bucket.max_seq_len, device=lengths.device)[None, :]
        visible = key_pos < lengths
        if window is not None:
            visible &= key_pos >= lengths - window
        return visible[:, None, None, :]


@dataclass
class _ExtendIndex:
    """One extend step's gather index and masks, shared by every layer.

    ``kv_slots`` lists every request's KV slots back to back, request ``i`` at
    ``kv_starts[i] : kv_starts[i] + seq_lens[i]``; ``new_kv_rows`` are the rows of that gather holding
    this step's new tokens, in token order (used when K/V are not saved to the cache).
    """

    seq_lens: list[int]
    new_lens: list[int]
    token_starts: list[int]
    kv_starts: list[int]
    kv_slots: torch.Tensor
    new_kv_rows: torch.Tensor
    device: torch.device
    tree_mask: torch.Tensor | None = None  # a tree verify step's [bs, t, t] (ForwardBatch.tree_mask)
    _masks: dict[int | None, list[torch.Tensor | None]] = field(default_factory=dict)

    @classmethod
    def of(cls, forward_batch: ForwardBatch) -> "_ExtendIndex":
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        device = req_to_token.device
        new_lens = _host_list(forward_batch.extend_seq_lens_cpu, forward_batch.extend_seq_lens)
        prefix_lens = _host_list(forward_batch.extend_prefix_lens_cpu, forward_batch.extend_prefix_lens)
        seq_lens = [p + n for p, n in zip(prefix_lens, new_lens)]
        max_seq_len = max(seq_lens, default=0)
        rows = req_to_token[forward_batch.req_pool_indices.to(device), :max_seq_len].long()
        kv_starts = _exclusive_cumsum(seq_lens)
        in_rows = _concat_ranges([i * max_seq_len for i in range(len(seq_lens))], seq_lens)
        new_kv_starts = [start + prefix for start, prefix in zip(kv_starts, prefix_lens)]
        return cls(
            seq_lens=seq_lens,
            new_lens=new_lens,
            token_starts=_exclusive_cumsum(new_lens),
            kv_starts=kv_starts,
            kv_slots=rows.flatten().index_select(0, in_rows.to(device, non_blocking=True)),
            new_kv_rows=_concat_ranges(new_kv_starts, new_lens).to(device, non_blocking=True),
            device=device,
            tree_mask=forward_batch.tree_mask,
        )

    def masks(self, window: int | None) -> list[torch.Tensor | None]:
        """Per request, a boolean ``[new_len, seq_len]`` mask (True = attend), None where every key is visible."""
        if window not in self._masks:
            if self.tree_mask is not None:
                self._masks[window] = [_tree_mask(seq - new, self.tree_mask[i], window)
                                       for i, (seq, new) in enumerate(zip(self.seq_lens, self.new_lens))]
            else:
                self._masks[window] = [_causal_mask(seq - new, new, window, self.device)
                                       for seq, new in zip(self.seq_lens, self.new_lens)]
        return self._masks[window]


def _step_index(forward_batch: ForwardBatch) -> _DecodeIndex | _ExtendIndex:
    if forward_batch.forward_mode.is_decode():
        return _DecodeIndex.of(forward_batch)
    return _ExtendIndex.of(forward_batch)


def _current_index(forward_batch: ForwardBatch, kind: type) -> Any:
    """The step's index from init_forward_metadata, or a fresh one when it was not called."""
    if not isinstance(forward_batch.attn_metadata, kind):
        forward_batch.attn_metadata = kind.of(forward_batch)
    return forward_batch.attn_metadata


def _gather_kv(
    k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch,
    kv_slots: torch.Tensor, new_kv_rows: torch.Tensor, save_kv_cache: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at ``kv_slots``, ``[len(kv_slots), num_kv_heads, head_dim]`` in the cache dtype."""
    kv_cache = forward_batch.kv_cache
    if save_kv_cache:
        kv_cache.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
    # index_select is several times faster than advanced indexing on CPU.
    keys = kv_cache.get_key_buffer(layer.layer_id).index_select(0, kv_slots)
    values = kv_cache.get_value_buffer(layer.layer_id).index_select(0, kv_slots)
    if not save_kv_cache:
        # The new tokens' K/V are not in the cache: put them where the gather expects them.
        keys.index_copy_(0, new_kv_rows, k.view(-1, layer.num_kv_heads, layer.head_dim).to(keys.dtype))
        values.index_copy_(0, new_kv_rows, v.view(-1, layer.num_kv_heads, layer.head_dim).to(values.dtype))
    return keys, values


def _length_buckets(lengths_longest_first: list[int], max_padding: int) -> list[_Bucket]:
    """Group lengths (sorted, longest first) into runs whose members are at most ``max_padding`` shorter
    than the run's first."""
    buckets: list[_Bucket] = []
    kv_start = 0
    for position, length in enumerate(lengths_longest_first):
        if not buckets or buckets[-1].max_seq_len - length > max_padding:
            if buckets:
                kv_start += buckets[-1].num_reqs * buckets[-1].max_seq_len
            buckets.append(_Bucket(first_req=position, num_reqs=0, max_seq_len=length, min_seq_len=length,
                                   kv_start=kv_start))
        buckets[-1].num_reqs += 1
        buckets[-1].min_seq_len = length
    return buckets


def _causal_mask(prefix_len: int, new_len: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    seq_len = prefix_len + new_len
    if new_len == 1 and (window is None or seq_len <= window):
        return None
    query_pos = torch.arange(prefix_len, seq_len, device=device)[:, None]
    key_pos = torch.arange(seq_len, device=device)[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    return visible


def _tree_mask(prefix_len: int, ancestors: torch.Tensor, window: int | None) -> torch.Tensor:
    """A tree verify row's ``[t, prefix_len + t]`` mask: the whole prefix, then the node's ancestors and itself;
    node ``a`` sits at position ``prefix_len + depth[a]`` (what a sliding window counts from)."""
    t = ancestors.shape[0]
    visible = torch.cat([torch.ones(t, prefix_len, dtype=torch.bool, device=ancestors.device), ancestors], dim=1)
    if window is not None:
        depth = ancestors.sum(dim=1) - 1
        key_pos = torch.cat([torch.arange(prefix_len, device=ancestors.device), prefix_len + depth])
        visible &= key_pos[None, :] > (prefix_len + depth)[:, None] - window
    return visible


def _concat_ranges(starts: list[int], lengths: list[int]) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])`` on the host, with no Python loop over tokens."""
    lengths_tensor = torch.tensor(lengths, dtype=torch.int64)
    shift = torch.tensor(starts, dtype=torch.int64) - torch.tensor(_exclusive_cumsum(lengths), dtype=torch.int64)
    return torch.arange(sum(lengths)) + torch.repeat_interleave(shift, lengths_tensor)


def _exclusive_cumsum(lengths: list[int]) -> list[int]:
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts


def _host_list(host: list[int] | None, device_values: torch.Tensor | None) -> list[int]:
    if host is not None:
        return [int(n) for n in host]
    if device_values is None:
        raise ValueError("an extend ForwardBatch needs extend_seq_lens and extend_prefix_lens")
    return [int(n) for n in device_values.tolist()]


@hookimpl
def treadle_register_attention_backends(register: Register) -> None:
    register("torch_native", TorchNativeAttnBackend)
