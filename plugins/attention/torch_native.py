"""The `torch_native` attention backend: plain PyTorch SDPA, one call per request.

It is the reference the other backends are checked against, so it favours
obviousness over speed: each request's K/V are gathered through
``req_to_token[req_pool_idx, :seq_len]`` (which makes any page size
transparent) and attended with ``scaled_dot_product_attention`` under an
explicit causal / sliding-window mask. Decode is extend with one new token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from treadle.core.attention import AttentionBackend, RadixAttention
from treadle.core.forward_batch import ForwardBatch
from treadle.core.hookspecs import Register, hookimpl


class TorchNativeAttnBackend(AttentionBackend):
    """Reference attention over the paged KV cache: GQA, sliding windows, any page size, runs on any device.

    Computes in the KV cache's dtype (float32 caches give float32 attention).
    """

    supports_cuda_graph = False

    def __init__(self, model_runner: Any) -> None:
        num_heads, num_kv_heads = int(model_runner.num_heads), int(model_runner.num_kv_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"torch_native attention needs num_heads ({num_heads}) to be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.device = torch.device(model_runner.device)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = int(model_runner.head_dim)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        forward_batch.attn_metadata = _RequestSpans.of(forward_batch)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
        forward_batch: ForwardBatch, save_kv_cache: bool,
    ) -> torch.Tensor:
        kv_cache = forward_batch.kv_cache
        if save_kv_cache:
            kv_cache.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        spans = forward_batch.attn_metadata
        if not isinstance(spans, _RequestSpans):
            spans = _RequestSpans.of(forward_batch)
            forward_batch.attn_metadata = spans
        k_buffer = kv_cache.get_key_buffer(layer.layer_id)
        v_buffer = kv_cache.get_value_buffer(layer.layer_id)
        compute_dtype, out_dtype = k_buffer.dtype, q.dtype
        q = q.view(-1, layer.num_heads, layer.head_dim).to(compute_dtype)
        k_new = k.view(-1, layer.num_kv_heads, layer.head_dim).to(compute_dtype)
        v_new = v.view(-1, layer.num_kv_heads, layer.head_dim).to(compute_dtype)
        group = layer.num_heads // layer.num_kv_heads
        masks = spans.masks(layer.sliding_window_size)
        out = torch.empty_like(q)
        for i in range(spans.batch_size):
            start, new_len, prefix_len = spans.token_starts[i], spans.new_lens[i], spans.prefix_lens[i]
            slots = spans.kv_slots[i]
            if save_kv_cache:
                keys, values = k_buffer[slots], v_buffer[slots]
            else:
                # The new tokens' K/V are not in the cache: take them from k, v directly.
                keys = torch.cat((k_buffer[slots[:prefix_len]], k_new[start : start + new_len]))
                values = torch.cat((v_buffer[slots[:prefix_len]], v_new[start : start + new_len]))
            if group > 1:
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            attended = F.scaled_dot_product_attention(
                q[start : start + new_len].transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=masks[i],
                scale=layer.scaling,
            )
            out[start : start + new_len] = attended.transpose(0, 1)
        return out.view(-1, layer.num_heads * layer.head_dim).to(out_dtype)


@dataclass
class _RequestSpans:
    """Per-request host-side lengths and device-side KV slots for one step; masks built once per window."""

    batch_size: int
    token_starts: list[int]
    new_lens: list[int]
    prefix_lens: list[int]
    kv_slots: list[torch.Tensor]
    device: torch.device
    _masks: dict[int | None, list[torch.Tensor | None]] = field(default_factory=dict)

    @classmethod
    def of(cls, forward_batch: ForwardBatch) -> "_RequestSpans":
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        bs = forward_batch.batch_size
        if forward_batch.forward_mode.is_decode():
            seq_lens = [int(n) for n in forward_batch.seq_lens_cpu.tolist()]
            new_lens = [1] * bs
            prefix_lens = [n - 1 for n in seq_lens]
        else:
            new_lens = _host_list(forward_batch.extend_seq_lens_cpu, forward_batch.extend_seq_lens)
            prefix_lens = _host_list(forward_batch.extend_prefix_lens_cpu, forward_batch.extend_prefix_lens)
        starts, total = [], 0
        for n in new_lens:
            starts.append(total)
            total += n
        rows = req_to_token[forward_batch.req_pool_indices.to(req_to_token.device)]
        kv_slots = [rows[i, : prefix_lens[i] + new_lens[i]].long() for i in range(bs)]
        return cls(bs, starts, new_lens, prefix_lens, kv_slots, req_to_token.device)

    def masks(self, window: int | None) -> list[torch.Tensor | None]:
        """Boolean ``[new_len, seq_len]`` masks (True = attend), None where every key is visible."""
        if window not in self._masks:
            self._masks[window] = [
                _causal_mask(prefix, new, window, self.device) for prefix, new in zip(self.prefix_lens, self.new_lens)
            ]
        return self._masks[window]


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


def _host_list(host: list[int] | None, device_values: torch.Tensor | None) -> list[int]:
    if host is not None:
        return [int(n) for n in host]
    if device_values is None:
        raise ValueError("an extend ForwardBatch needs extend_seq_lens and extend_prefix_lens")
    return [int(n) for n in device_values.tolist()]


@hookimpl
def treadle_register_attention_backends(register: Register) -> None:
    register("torch_native", TorchNativeAttnBackend)
