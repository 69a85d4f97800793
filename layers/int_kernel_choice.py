"""Which Triton kernels (``kernels/int_kernel_plan.py``) each integer weight shape runs, chosen once at load.

For each shape the candidate launch configs of the one-token GEMV and of the ``tl.dot`` kernels (``magic_mma``,
``int_mma`` and ``int_dot``, at 16, 32 and 64 rows) and of the dequantization (at 512 rows), with 16-bit activations
``wide_mma``'s three or four launches against the dequantization and the library matmul at 128, 256, 512 and 1024 rows (up
to the first bucket it loses: how many rows it runs), else the 64 rows' winner against them at 128 and 256 rows
(how many rows the ``tl.dot`` kernels run), and where a bucket's ``natural_mma`` launch has no split-K, that launch
with a ``[gate | up]`` weight's ``silu(gate) * up`` in its epilogue against it followed by ``silu_mul``
(``SiluMulTiles``), are timed on the layer's weight, replayed from a CUDA graph with each call on another copy of the
weight so it is read from memory as a decode step reads it (``layers/small_batch.py``'s timing), each call
prefetching the next one's head into L2 as the model's calls do (``small_batch.chain_l2_prefetch``), and the fastest
kept. With ``TREADLE_SMALL_BATCH_MATMUL`` set to ``triton`` or ``library`` nothing is timed: the first candidates run
(and no ``wide_mma``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from treadle.kernels.fused_ops import use_triton
from treadle.layers import kernel_choices, small_batch

logger = logging.getLogger(__name__)


def int_kernel_plan(layer: nn.Module) -> Any:
    """The kernels a repacked layer (``layers/packed_int.py``) runs on its GPU (an ``IntKernelPlan``), timed once
    per weight shape; None off CUDA or with ``TREADLE_DISABLE_FUSED_OPS=1`` (the torch path)."""
    if not layer.weight.is_cuda or not layer.panels:
        return None
    if not use_triton(layer.weight):
        return None
    from treadle.kernels.int_kernel_plan import plan_kernels

    n, k = layer.weight.shape[0], layer.weight.shape[1] * (32 // layer.bits)
    key = (n, k, layer.bits, layer.group_size, layer.weight_zeros is not None, layer.int_out_dtype,
           str(layer.weight.device))
    if key not in _plans:
        from tqdm.auto import tqdm

        sm_count = torch.cuda.get_device_properties(layer.weight.device).multi_processor_count
        timed = small_batch.mode() == "auto"
        # The first start on a machine compiles every launch it times (Triton caches them on disk for the next):
        # dozens a shape, so a count of the launches timed so far.
        with tqdm(unit="config", leave=False, disable=not timed,
                  desc=f"timing int{layer.bits} matmuls for {n} x {k}") as progress:
            pick = _timed_pick(layer, progress.update) if timed else None
            _plans[key] = plan_kernels(n, k, layer.bits, layer.group_size, sm_count, pick, layer.int_out_dtype)
        logger.info("int%d matmul %d x %d: %s", layer.bits, n, k, _plans[key])
    return _plans[key]  # an IntKernelPlan, or None: the torch path


def reserve_dequant_buffer(layer: nn.Module) -> Any:
    """The buffer a repacked layer's large batches dequantize into (``kernels/packed_int_dequant.py``'s
    ``DequantBuffer``: one per device while layers hold it), sized for this layer's weight; None without kernels."""
    if layer.int_kernels is None:
        return None
    from treadle.kernels.packed_int_dequant import shared_dequant_buffer

    buffer = shared_dequant_buffer(layer.weight.device)
    buffer.reserve(layer.weight.shape[0], layer.weight.shape[1] * (32 // layer.bits), layer.int_out_dtype)
    return buffer


# (N, K, bits, group, zeros, dtype, device) -> the kernels that shape runs (timed once per process).
_plans: dict[tuple, Any] = {}


# (N, K, rows) -> seconds per call of the launch the loader kept for that row bucket (timed ones only).
_kept_seconds: dict[tuple[int, int, int], float] = {}


def chosen_plans() -> dict[tuple[int, int], Any]:
    """``(N, K)`` -> the kernels each integer weight shape loaded in this process runs (an ``IntKernelPlan``; None:
    the torch path), for benchmarks to print."""
    return {key[:2]: plan for key, plan in _plans.items()}


def kept_seconds() -> dict[tuple[int, int, int], float]:
    """``(N, K, rows)`` -> the loader's timing of the launch it kept for each shape and row bucket (1, 16, 32, 64;
    at 128 to 1024 rows ``wide_mma``'s or the dequantization, or at 128 and 256 the 64 rows' launch; at 512 the
    dequantization alone where no ``wide_mma`` bucket reached it), for benchmarks to set beside a decode step's."""
    return dict(_kept_seconds)


def _timed_pick(layer: nn.Module, timed_one: Callable[[int], Any] = lambda count: None) -> Callable[[list, int], Any]:
    """Times each candidate launch config on this layer's weight (replayed from a CUDA graph, each call on another
    copy of the weight so it is read from memory, as a decode step reads it) and keeps the fastest;
    ``timed_one(1)`` after each (a progress bar's ``update``). A choice made at an earlier start on this machine
    and code (``layers/kernel_choices.py``) is taken without timing."""
    from treadle.kernels.int_kernel_plan import SiluMulTiles, run_tiles

    copies: list[tuple[torch.Tensor, Any]] = []  # made at the first launch timed (none when every choice was kept)
    scales, zeros = layer.weight_scales.data, layer.weight_zeros
    n, k = layer.weight.shape[0], layer.weight.shape[1] * (32 // layer.bits)
    device = layer.weight.device

    def keep(tiles: Any, rows: int, seconds: float) -> Any:
        if not isinstance(tiles, SiluMulTiles):  # the matmul's launch per bucket, not the gated MLP's product
            _kept_seconds[(n, k, rows)] = seconds
        return tiles

    def pick(candidates: list, rows: int) -> Any:
        key = ("int", n, k, layer.bits, layer.group_size, zeros is not None, layer.int_out_dtype, rows)
        cached = kernel_choices.cached_choice(key, candidates, device)
        if cached is not None:
            timed_one(len(candidates))
            return keep(candidates[cached[0]], rows, cached[1])
        if not copies:
            # Each call prefetches the next one's head into L2, as in the model (small_batch.chain_l2_prefetch): the
            # same compiled launches as the model's, timed as the model runs them.
            copies.extend((weight, small_batch.l2_prefetch_bytes(weight, small_batch.l2_prefetch_limit()))
                          for weight in small_batch.weight_copies(layer.weight.data))
        x = torch.randn(rows, k, dtype=layer.int_out_dtype, device=device)
        timings = {}
        for tiles in candidates:
            def run(i: int, tiles=tiles) -> torch.Tensor:
                return run_tiles(x, copies[i % len(copies)][0], scales, zeros, layer.bits, layer.group_size, tiles,
                                 copies[(i + 1) % len(copies)][1])
            try:
                timings[tiles] = small_batch.graph_seconds(run)
            except Exception as exc:  # a config that does not compile on this GPU is skipped, not fatal
                logger.info("int matmul config %s skipped: %s", tiles, exc)
            timed_one(1)
        if not timings:
            return candidates[0]
        best = min(timings, key=timings.get)
        kernel_choices.store_choice(key, candidates, device, candidates.index(best), timings[best])
        return keep(best, rows, timings[best])

    return pick
