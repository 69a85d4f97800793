"""Device memory for requests and KV: ReqToTokenPool and KVCache."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import numpy as np
import torch


class ReqToTokenPool:
    """Maps (request slot, position) to the KV slot holding that token's K/V.

    ``req_to_token`` lives on the device for attention backends; the scheduler
    keeps each request's slots on the host too (``Req.kv_slots``), so it never
    reads this table back.
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self._free = list(range(size))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop(0) if self._free else None

    def free(self, index: int) -> None:
        self._free.append(index)

    def clear(self) -> None:
        self._free = list(range(self.size))


class KVCache:
    """Per-layer K and V buffers of shape ``[num_slots, num_kv_heads, head_dim]`` (``k_buffers``, ``v_buffers``),
    views of one tensor ``kv_buffer`` ``[2 * num_layers, num_slots, num_kv_heads, head_dim]``.

    The first ``page_size`` slots are padding that no request owns: CUDA-graph
    padding and dummy writes go there.

    With an FP8 ``dtype`` (``cache.kv_dtype: fp8_e4m3``) the buffers hold
    ``k / k_scale`` and ``v / v_scale`` saturated to the FP8 range, one scale per
    layer (``k_scales[layer]``, ``v_scales[layer]``, 1.0 unless set); attention
    backends multiply the scales back in. Other dtypes store values as they are.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.is_fp8 = dtype in FP8_KV_DTYPES
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers
        # Every layer's K then every layer's V in one tensor, so that moving slots in all layers (a draft tree's
        # kept path, core/speculative/tree.py) is one gather and one scatter, not two per layer.
        self.kv_buffer = _zeros((2 * num_layers, size + page_size, num_kv_heads, head_dim), dtype, self.device)
        self.k_buffers = list(self.kv_buffer[:num_layers].unbind(0))
        self.v_buffers = list(self.kv_buffer[num_layers:].unbind(0))
        self._store_kv = _one_kernel_kv_write(self.device)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffers[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffers[layer_id]

    def copy_slots(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy the K and V of slots ``source`` to slots ``target`` (int64, same length, on the device) in every
        layer: every source is read before any target is written (two kernels, whatever the layer count)."""
        self.kv_buffer.index_copy_(1, target, self.kv_buffer.index_select(1, source))

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v (``[n, num_kv_heads, head_dim]`` or flattened) at slots ``loc``; on a GPU with Triton,
        in one kernel (``kv_store.py``)."""
        if self._store_kv is not None:
            self._store_kv(self.k_buffers[layer_id], self.v_buffers[layer_id], loc, k, v, self.k_scales[layer_id],
                           self.v_scales[layer_id])
            return
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.is_fp8:
            k = _to_fp8(k, self.k_scales[layer_id], self.dtype)
            v = _to_fp8(v, self.v_scales[layer_id], self.dtype)
        self.k_buffers[layer_id][loc] = k.to(self.dtype)
        self.v_buffers[layer_id][loc] = v.to(self.dtype)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


FP8_KV_DTYPES = (torch.float8_e4m3fn,)
# cache.kv_dtype -> storage dtype; "auto" stores the model dtype.
KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled buffer. On the CPU it is calloc'ed (numpy.zeros): the OS hands out zero pages as they are first
    written, so the slots a run never uses cost neither time nor memory (torch.zeros writes every byte: 0.6 s and
    1.8 GB for the default model's pool)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(size, dtype=np.uint8)).view(dtype).view(shape)


def _one_kernel_kv_write(device: torch.device) -> Any:
    """``kv_store.store_kv`` on a GPU with Triton; None elsewhere (the index-put path)."""
    if device.type != "cuda" or importlib.util.find_spec("triton") is None:
        return None
    from treadle.kernels.kv_store import store_kv

    return store_kv


def _to_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    # A cast to FP8 turns out-of-range values into NaN; saturate first.
    limit = torch.finfo(dtype).max
    if scale != 1.0:
        x = x / scale
    return x.clamp(-limit, limit).to(dtype)
