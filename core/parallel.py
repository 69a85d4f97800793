"""Tensor-parallel state of this process and the collectives the model layers use.

One torch.distributed world is one tensor-parallel group (one replica): NCCL
between GPUs, gloo on the CPU. A second gloo group carries the scheduler's
pickled control messages beside NCCL. At ``tp_size`` 1 (the default) no process
group exists and every function here is the identity or a no-op, so a
single-device run takes no collective path at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class TensorParallelGroup:
    """This process's place in its tensor-parallel group; ``size == 1`` means no group."""

    rank: int = 0
    size: int = 1
    device_group: Any = None  # tensors: NCCL on CUDA, gloo on the CPU
    cpu_group: Any = None  # pickled objects and host integers: always gloo


_group = TensorParallelGroup()
_CONTROL_TIMEOUT = timedelta(days=7)


def get_tp_rank() -> int:
    return _group.rank


def get_tp_size() -> int:
    return _group.size


def get_tp_group() -> TensorParallelGroup:
    return _group


def init_tensor_parallel(
    rank: int, size: int, init_method: str, device: torch.device, timeout_s: float = 600.0
) -> None:
    """Join the group of ``size`` ranks at ``init_method`` (``tcp://host:port``, rank 0 hosts the store).

    Tensor collectives fail after ``timeout_s`` instead of hanging; rank 0's control broadcasts may
    wait as long as it idles, but fail at once when a peer's process is gone (its connection closes).
    """
    global _group
    if size == 1:
        _group = TensorParallelGroup()
        return
    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout, **kwargs
    )
    # Control messages wait as long as rank 0 idles; a peer that dies still fails them at once
    # (its connection closes), so only a hung peer waits this long.
    cpu_group = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    _group = TensorParallelGroup(rank, size, dist.group.WORLD, cpu_group)
    logger.info("tensor-parallel rank %d of %d joined via %s (%s)", rank, size, init_method, backend)


def destroy_tensor_parallel() -> None:
    """Leave the group (no-op at tp 1)."""
    global _group
    if _group.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _group = TensorParallelGroup()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over the ranks, in place; ``x`` itself at tp 1."""
    if _group.size == 1:
        return x
    dist.all_reduce(x, group=_group.device_group)
    return x


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """The ranks' ``x`` concatenated along the last dim in rank order; ``x`` itself at tp 1."""
    if _group.size == 1:
        return x
    x = x.contiguous()
    gathered = torch.empty((_group.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(gathered, x, group=_group.device_group)
    stacked = gathered.view((_group.size,) + tuple(x.shape))
    return stacked.movedim(0, -2).reshape(*x.shape[:-1], _group.size * x.shape[-1])


# torch 2.13 renamed all_gather_into_tensor; older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tp_broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (pickled over the gloo group); ``obj`` itself at tp 1."""
    if _group.size == 1:
        return obj
    payload = [obj if _group.rank == 0 else None]
    dist.broadcast_object_list(payload, src=0, group=_group.cpu_group)
    return payload[0]


def tp_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order, on every rank (over the gloo group); ``[obj]`` at tp 1."""
    if _group.size == 1:
        return [obj]
    gathered: list[Any] = [None] * _group.size
    dist.all_gather_object(gathered, obj, group=_group.cpu_group)
    return gathered


def tp_min_int(value: int) -> int:
    """The smallest ``value`` over the ranks (e.g. KV pool sizes, so every rank schedules alike)."""
    if _group.size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=_group.cpu_group)
    return int(tensor.item())


def tp_head_counts(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """Query and KV heads held by one rank; KV heads are replicated when ``tp_size`` exceeds their count.

    Raises ValueError when the heads cannot be split evenly over ``tp_size`` ranks.
    """
    if num_heads % tp_size != 0:
        raise ValueError(
            f"parallel.tp_size={tp_size} does not divide the model's {num_heads} attention heads; "
            f"use a tp_size that divides {num_heads}"
        )
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size != 0:
            raise ValueError(
                f"parallel.tp_size={tp_size} does not divide the model's {num_kv_heads} KV heads; "
                f"use a tp_size that divides {num_kv_heads} or a multiple of it"
            )
        return num_heads // tp_size, num_kv_heads // tp_size
    if tp_size % num_kv_heads != 0:
        raise ValueError(
            f"parallel.tp_size={tp_size} is larger than the model's {num_kv_heads} KV heads but not a multiple "
            f"of it, so the KV heads cannot be replicated evenly"
        )
    return num_heads // tp_size, 1


def tp_kv_head_start(num_kv_heads: int, tp_rank: int, tp_size: int) -> int:
    """Index of the first KV head rank ``tp_rank`` holds (ranks share a head when they replicate it)."""
    if num_kv_heads >= tp_size:
        return tp_rank * (num_kv_heads // tp_size)
    return tp_rank // (tp_size // num_kv_heads)
