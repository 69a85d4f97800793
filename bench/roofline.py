"""The bandwidth roofline of a decode step: the bytes it must read over the copy bandwidth measured here.

``roofline_seconds`` counts every weight except the embedding table (only the
looked-up rows), plus the KV cache of every request at the mean decode length;
``measure_copy_bandwidth`` times a device-to-device copy, counting bytes read and
written. Also the device helpers the one-batch benchmark times and frees with.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import torch


def roofline_seconds(model: torch.nn.Module, runner: Any, bs: int, input_len: int, steps: int,
                     bandwidth: float) -> float:
    """Bytes one decode step must read (weights + KV at the mean decode length) over ``bandwidth``."""
    embedding = model.get_submodule("model.embed_tokens").weight
    seen, weight_bytes = set(), 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        weight_bytes += param.numel() * param.element_size()
    lm_head = model.get_submodule("lm_head").weight
    if lm_head is not embedding:  # an untied table is only gathered: bs rows, not all of it
        weight_bytes -= embedding.numel() * embedding.element_size()
        weight_bytes += bs * embedding.shape[1] * embedding.element_size()
    mean_len = input_len + (steps + 1) / 2
    kv_bytes = bs * mean_len * 2 * runner.num_layers * runner.num_kv_heads * runner.head_dim * \
        runner.kv_cache.k_buffers[0].element_size()
    return (weight_bytes + kv_bytes) / bandwidth


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written (median)."""
    if device.type != "cuda":
        nbytes, iters = 1 << 26, 5
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 3):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        if i >= 3:
            times.append(time.perf_counter() - start)
    del src, dst
    free_memory()
    return 2 * nbytes / statistics.median(times)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
