"""Tensor-parallel state of this process and the collectives the model layers use.

One torch.distributed world is one tensor-parallel group (one replica): NCCL
between GPUs, gloo on the CPU. A second gloo group carries the scheduler's
pickled control messages beside NCCL. At ``tp_size`` 1 (the default) no process
group exists and every function here is the identity or a no-op, so a
single-device run takes no collective path at all.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable
from urllib.parse import urlparse

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
    custom_all_reduce: Any = None  # the peer all-reduce for small messages (custom_all_reduce.py), or None


_group = TensorParallelGroup()
_CONTROL_TIMEOUT = timedelta(days=7)
_CHECK_IN_POLL_S = 0.05


def get_tp_rank() -> int:
    return _group.rank


def get_tp_size() -> int:
    return _group.size


def get_tp_group() -> TensorParallelGroup:
    return _group


def init_tensor_parallel(
    rank: int, size: int, init_method: str, device: torch.device, timeout_s: float = 600.0,
    check_peers: Callable[[], None] | None = None,
) -> None:
    """Join the group of ``size`` ranks at ``init_method`` (``tcp://host:port`` or ``file://path``; rank 0
    hosts the store).

    Rank 0 first waits for every other rank to check in at the store, calling ``check_peers`` between
    polls: it raises to give up at once (a local rank's process has died), where torch's own rendezvous
    could only wait out ``timeout_s``. A rank that never checks in makes rank 0 raise ``TimeoutError``
    after ``timeout_s`` (ranks on other nodes: rank 0 cannot see their processes).

    Tensor collectives fail after ``timeout_s`` instead of hanging; rank 0's control broadcasts may
    wait as long as it idles, but fail at once when a peer's process is gone (its connection closes).
    """
    global _group
    if size == 1:
        _group = TensorParallelGroup()
        return
    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = _open_store(init_method, rank, size, timeout)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    if rank == 0:
        _wait_for_ranks(store, size, init_method, timeout_s, check_peers)
    else:
        # As late as possible: a rank that fails inside init_process_group itself (after checking in)
        # still holds rank 0 there until timeout_s.
        store.set(_checked_in_key(rank), "1")
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout, **kwargs)
    # Control messages wait as long as rank 0 idles; a peer that dies still fails them at once
    # (its connection closes), so only a hung peer waits this long.
    cpu_group = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    _group = TensorParallelGroup(rank, size, dist.group.WORLD, cpu_group)
    logger.info("tensor-parallel rank %d of %d joined via %s (%s)", rank, size, init_method, backend)


def destroy_tensor_parallel() -> None:
    """Leave the group (no-op at tp 1)."""
    global _group
    _group.custom_all_reduce = None  # its peer buffers go before the group they were exchanged over
    if _group.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _group = TensorParallelGroup()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over the ranks, in place; ``x`` itself at tp 1. Small messages on GPUs with peer access take
    the peer-to-peer all-reduce (``custom_all_reduce.py``) where it is installed, the rest NCCL (gloo on CPUs)."""
    if _group.size == 1:
        return x
    fast = _group.custom_all_reduce
    if fast is not None and fast.handles(x):
        return fast(x)
    dist.all_reduce(x, group=_group.device_group)
    return x


def tp_all_reduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rmsnorm(sum + residual) * weight, sum + residual)`` with ``sum`` the all-reduce of ``x``, in one kernel
    where the peer all-reduce takes this size; None where it does not (the caller all-reduces, then norms)."""
    fast = _group.custom_all_reduce
    if fast is None or not fast.handles_add_rmsnorm(x, residual):
        return None
    return fast.all_reduce_add_rmsnorm(x, residual, weight, eps)


def install_custom_all_reduce(fast: Any) -> None:
    """Route ``tp_all_reduce``'s messages that ``fast.handles`` to ``fast(x)`` (None: NCCL for all). Every rank
    must install the same kind, or their collectives would not meet."""
    _group.custom_all_reduce = fast


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


def _open_store(init_method: str, rank: int, size: int, timeout: timedelta) -> Any:
    """The store torch's own rendezvous would open for ``init_method``, except that rank 0's TCP store
    does not wait for its clients: rank 0 waits in :func:`_wait_for_ranks`, where it can give up early."""
    url = urlparse(init_method)
    if url.scheme == "tcp" and url.hostname and url.port:
        store = dist.TCPStore(url.hostname, url.port, size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False, multi_tenant=True)
    elif url.scheme == "file" and url.path:
        store = dist.FileStore(url.path, size)
    else:
        raise ValueError(f"tensor-parallel init_method {init_method!r} is neither tcp://host:port nor file://path")
    store.set_timeout(timeout)
    return store


def _checked_in_key(rank: int) -> str:
    return f"treadle/checked_in/{rank}"


def _wait_for_ranks(store: Any, size: int, init_method: str, timeout_s: float,
                    check_peers: Callable[[], None] | None) -> None:
    deadline = time.monotonic() + timeout_s
    missing = list(range(1, size))
    while True:
        if check_peers is not None:
            check_peers()
        missing = [rank for rank in missing if not store.check([_checked_in_key(rank)])]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"tensor-parallel rank(s) {missing} did not reach the rendezvous at {init_method} within "
                f"parallel.dist_timeout_s={timeout_s:g} s; on another node, check that its `treadle serve` "
                f"runs with the same parallel settings, can reach that address, and has not failed (its log)")
        time.sleep(_CHECK_IN_POLL_S)
