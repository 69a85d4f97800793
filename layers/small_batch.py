"""Which matmul each linear layer runs for decode-sized batches, chosen by timing at load.

On a GPU, a batch of at most ``SMALL_BATCH_ROWS`` tokens of an FP8 layer may run the Triton kernel of
``small_batch_kernels.py`` instead of the library matmul (``torch._scaled_mm``), and a 16-bit layer instead of
``F.linear`` (cuBLAS). At load each weight shape
times the library matmul and every Triton launch config at each size of ``ROW_BUCKETS`` (replayed from a CUDA
graph, as decode runs them, each call on another copy of the weight so none is read from L2) and keeps the
fastest per bucket; a batch uses the choice of the smallest bucket that holds it. The choice is made once per
shape and process (a model's 32 layers share it) and logged.

``TREADLE_SMALL_BATCH_MATMUL`` (or :func:`set_mode`) overrides it for A/B runs: ``auto`` (the default),
``library`` (never the Triton kernel) or ``triton`` (always, with the first config).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from treadle.core.execution.cuda_graph import replay_seconds
from treadle.layers import kernel_choices

if TYPE_CHECKING:
    from treadle.kernels.small_batch import SmallBatchConfig

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 16, 32)
SMALL_BATCH_ROWS = ROW_BUCKETS[-1]
MODES = ("auto", "library", "triton")

_mode: str | None = None


def set_mode(chosen: str | None) -> None:
    """Force ``library`` or ``triton`` for layers loaded from now on; ``auto`` restores timing, None lets
    ``TREADLE_SMALL_BATCH_MATMUL`` decide again."""
    if chosen is not None and chosen not in MODES:
        raise ValueError(f"small-batch matmul mode {chosen!r} is not one of {', '.join(MODES)}")
    global _mode
    _mode = chosen


def mode() -> str:
    """The mode layers loaded now use (see the module docstring)."""
    chosen = _mode or os.environ.get("TREADLE_SMALL_BATCH_MATMUL", "auto")
    if chosen not in MODES:
        raise ValueError(f"TREADLE_SMALL_BATCH_MATMUL={chosen!r} is not one of {', '.join(MODES)}")
    return chosen


@dataclass(frozen=True)
class SmallBatchKernels:
    """The Triton config (None: the library matmul) one weight shape runs for each of ``ROW_BUCKETS``."""

    per_bucket: tuple[SmallBatchConfig | None, ...]

    def for_rows(self, rows: int) -> SmallBatchConfig | None:
        """The config for a batch of ``rows`` tokens (None above ``SMALL_BATCH_ROWS``: the library matmul)."""
        for bucket, config in zip(ROW_BUCKETS, self.per_bucket):
            if rows <= bucket:
                return config
        return None

    def describe(self) -> str:
        parts, low = [], 1
        for bucket, config in zip(ROW_BUCKETS, self.per_bucket):
            rows = "1 row" if bucket == 1 else f"{low}-{bucket} rows"
            parts.append(f"{rows}: {'library' if config is None else f'triton {config}'}")
            low = bucket + 1
        return "; ".join(parts)


# (kind, N, K, weight dtype, activation dtype, device) -> what won on this GPU.
_choices: dict[tuple[str, int, int, torch.dtype, torch.dtype, str], SmallBatchKernels] = {}


def choose(kind: str, weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
           library: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], configs: Sequence[SmallBatchConfig]
           ) -> SmallBatchKernels | None:
    """The kernels a ``weight`` [N, K] (``kind``: "bf16", "fp8", ... for reports) runs at decode batch sizes
    with ``dtype`` activations; ``library(x, weight)`` is the matmul it runs otherwise. None: always the
    library."""
    chosen_mode = mode()
    if chosen_mode == "library":
        return None
    if chosen_mode == "triton":
        return SmallBatchKernels((configs[0],) * len(ROW_BUCKETS))
    key = (kind, weight.shape[0], weight.shape[1], weight.dtype, dtype, str(weight.device))
    if key not in _choices:
        from tqdm.auto import tqdm

        # GEMV configs read the weight once per row: they are timed at one row only.
        per_bucket = {rows: [c for c in configs if rows == 1 or not c.gemv] for rows in ROW_BUCKETS}
        # The first start on a machine compiles every config (Triton caches them on disk for the next).
        with tqdm(total=sum(len(c) + 1 for c in per_bucket.values()), unit="config", leave=False,
                  desc=f"timing decode matmuls for {kind} {key[1]} x {key[2]}") as progress:
            _choices[key] = SmallBatchKernels(tuple(
                _fastest(weight, scale, dtype, rows, library, candidates, progress.update)
                for rows, candidates in per_bucket.items()))
        logger.info("small-batch matmul, %s %d x %d: %s", kind, key[1], key[2], _choices[key].describe())
    return _choices[key]


def matmul(kernels: SmallBatchKernels | None, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
           prefetch: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x @ (weight * scale).T`` for ``x`` [M, K] through the Triton config ``kernels`` chose for M rows;
    None where the caller runs its library matmul (no choice, ``x`` not 2-D, M above the buckets, or no rows)."""
    config = _config_for(kernels, x)
    if config is None:
        return None
    from treadle.kernels.small_batch import small_batch_matmul

    return small_batch_matmul(_unit_stride(x), weight, scale, config, prefetch=prefetch)


def silu_mul_matmul(kernels: SmallBatchKernels | None, x: torch.Tensor, weight: torch.Tensor,
                    scale: torch.Tensor | None, prefetch: torch.Tensor | None = None) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``x @ (weight * scale).T`` = ``[gate | up]`` in one kernel where ``kernels`` chose a
    Triton config without split-K for M rows (on an H100 a gated MLP's one-token GEMV and its 128-column tiles at
    17-32 rows); None otherwise (the caller runs :func:`matmul` or its library matmul, then ``silu_mul``)."""
    config = _config_for(kernels, x)
    if config is None:  # before the import: off a GPU (no kernels chosen) Triton need not be installed
        return None
    from treadle.kernels.small_batch import fuses_silu_mul, small_batch_matmul

    if not fuses_silu_mul(config):
        return None
    return small_batch_matmul(_unit_stride(x), weight, scale, config, silu_mul=True, prefetch=prefetch)


def add_rmsnorm_matmul(kernels: SmallBatchKernels | None, x: torch.Tensor, weight: torch.Tensor,
                       scale: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float, prefetch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rmsnorm(y + residual) * norm_weight, y + residual)`` for ``y = x @ (weight * scale).T``, the norm computed
    by the kernel's last program to finish, where ``kernels`` chose a GEMV for one row of ``x`` (a decode step of
    one request: the layer's next norm needs no kernel of its own); None otherwise."""
    if not fuses_add_rmsnorm(kernels, x):
        return None
    from treadle.kernels.small_batch import small_batch_matmul

    return small_batch_matmul(_unit_stride(x), weight, scale, _config_for(kernels, x),
                              add_rmsnorm=(residual.contiguous(), norm_weight, eps), prefetch=prefetch)


def split_matmul(kernels: SmallBatchKernels | None, x: torch.Tensor, weight: torch.Tensor,
                 split: Callable[[], Any], prefetch: torch.Tensor | None = None, silu_mul: bool = False,
                 add_rmsnorm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                 library: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> Any:
    """``x @ weight.T`` (16-bit) with a split output delta (``split()``: a ``layers/output_delta.py``
    ``SplitDelta``), then the delta's second half: added (the result), or ``silu_mul`` / ``add_rmsnorm``'s result.
    Through the Triton config ``kernels`` chose for M rows, its launch running the delta's ``beside`` (a LoRA
    shrink in extra programs) where the delta gives one; else, and through ``library(x, weight)`` where no config
    runs for ``x`` (cuBLAS), the delta's ``apart`` runs the first half in its own launch after the matmul. None
    where neither can run or ``split()`` gives None (nothing ran)."""
    config = _config_for(kernels, x)
    if config is not None and config.w8a8:
        return None
    if config is None and (library is None or x.dim() != 2 or not x.shape[0]):  # no matmul to split around
        return None
    delta = split()
    if delta is None:
        return None
    beside = delta.beside if config is not None else None
    if beside is None and getattr(delta, "apart", None) is None:  # a split written before apart: only beside
        return None
    if config is None:
        y = library(x, weight)
    else:
        from treadle.kernels.small_batch import small_batch_matmul

        y = small_batch_matmul(_unit_stride(x), weight, None, config, prefetch=prefetch, beside=beside)
    if beside is None:
        delta.apart(x)
    if silu_mul:
        return delta.silu_mul(y)
    if add_rmsnorm is not None:
        # Where the one-token GEMV would have fused add + RMSNorm, the split rounds as that path did.
        warps = config.num_warps if fuses_add_rmsnorm(kernels, x) else None
        return delta.add_rmsnorm(y, *add_rmsnorm, gemv_warps=warps)
    delta.add(y)
    return y


def fuses_add_rmsnorm(kernels: SmallBatchKernels | None, x: torch.Tensor) -> bool:
    """Whether :func:`add_rmsnorm_matmul` runs its kernel for ``x`` (rather than returning None)."""
    config = _config_for(kernels, x)
    return config is not None and config.gemv and x.shape[0] == 1


def chain_l2_prefetch(layers: Sequence[Any]) -> None:
    """Give each of ``layers`` (linear layers in the order a forward runs them) the head of the next one's weight
    to prefetch into L2 from its decode kernels (``layer.l2_prefetch``; the last layer's next is the first, for the
    next step). ``TREADLE_L2_PREFETCH_MB`` (default 8, 0: off) sets how much of each weight."""
    limit = l2_prefetch_limit()
    for layer, following in zip(layers, list(layers[1:]) + list(layers[:1])):
        layer.l2_prefetch = l2_prefetch_bytes(following.weight, limit) if len(layers) > 1 else None


def l2_prefetch_limit() -> int:
    """Bytes of each next weight the decode kernels prefetch: ``TREADLE_L2_PREFETCH_MB`` (default 8; 0: none)."""
    return int(float(os.environ.get("TREADLE_L2_PREFETCH_MB", "8")) * 2**20)


def l2_prefetch_bytes(weight: torch.Tensor, limit: int) -> torch.Tensor | None:
    """The first ``limit`` bytes of a contiguous CUDA ``weight`` (whole 128-byte lines), as a uint8 view: what a
    small-batch kernel asks L2 to fetch for the kernel after it. None off CUDA, where Triton runs interpreted
    (no inline assembly there), or for less than a line."""
    if not weight.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" or not weight.is_contiguous():
        return None
    flat = weight.detach().reshape(-1).view(torch.uint8)
    lines = min(limit, flat.numel()) // 128
    return flat[: lines * 128] if lines else None


def _config_for(kernels: SmallBatchKernels | None, x: torch.Tensor) -> SmallBatchConfig | None:
    """The Triton config ``kernels`` chose for the rows of a 2-D ``x`` (None: no choice, not 2-D, too many rows,
    or none)."""
    return kernels.for_rows(x.shape[0]) if kernels is not None and x.dim() == 2 and x.shape[0] else None


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def choices() -> dict[str, str]:
    """What each weight shape (``"kind N x K"``) runs at decode batch sizes on this GPU (for reports)."""
    return {f"{kind} {n} x {k}": choice.describe() for (kind, n, k, _, _, _), choice in _choices.items()}


def _fastest(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, rows: int,
             library: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], configs: Sequence[SmallBatchConfig],
             timed: Callable[[], Any] = lambda: None) -> SmallBatchConfig | None:
    from treadle.kernels.small_batch import small_batch_matmul

    if not configs:  # the library alone: nothing to time
        timed()
        return None
    listed = [None, *configs]  # None: the library matmul
    key = ("small_batch", *weight.shape, weight.dtype, scale is not None, dtype, rows)
    cached = kernel_choices.cached_choice(key, listed, weight.device)  # chosen at an earlier start here
    if cached is not None:
        for _ in listed:
            timed()
        return listed[cached[0]]
    x = torch.randn(rows, weight.shape[1], dtype=dtype, device=weight.device)
    weights = weight_copies(weight)
    candidates: dict[Any, Callable[[int], torch.Tensor]] = {
        None: lambda i: library(x, weights[i % len(weights)])}
    for config in configs:
        candidates[config] = lambda i, config=config: small_batch_matmul(x, weights[i % len(weights)], scale, config)
    timings = {}
    for config, run in candidates.items():
        try:
            timings[config] = graph_seconds(run)
        except Exception as exc:  # a config that does not compile on this GPU is skipped, not fatal
            logger.info("small-batch config %s skipped: %s", config, exc)
        timed()
    best = min(timings, key=timings.get)
    kernel_choices.store_choice(key, listed, weight.device, listed.index(best), timings[best])
    return best


def weight_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """``weight`` and enough copies of it that cycling through them reads from memory, not from the L2 cache,
    as each layer's weight is read once per decode step (a 4096 x 4096 bf16 weight fits an H100's 50 MB L2)."""
    l2_bytes = torch.cuda.get_device_properties(weight.device).L2_cache_size
    count = -(-2 * l2_bytes // (weight.numel() * weight.element_size()))
    return [weight] + [weight.clone() for _ in range(count)]


def graph_seconds(run: Callable[[int], Any], per_graph: int = 12, replays: int = 5) -> float:
    """Device time of one ``run(i)`` (``i`` counts the calls), replayed from a CUDA graph as decode runs it
    (no launch gaps)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles, and warms up outside the capture
        for i in range(3):
            run(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            run(i)
    return replay_seconds(graph, replays) / per_graph
