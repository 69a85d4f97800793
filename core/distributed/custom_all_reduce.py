"""A peer-to-peer all-reduce for the small messages of a decode step, beside NCCL.

Each rank allocates one buffer once, mapped into every other rank's address space (torch's symmetric memory,
CUDA backend, NVLink multicast switched off); a Triton kernel (``kernels/peer_all_reduce.py``) pushes the
tensor into the peers' buffers, exchanges a flag per program and sums locally: one launch, no host work, so it
is captured in the decode CUDA graphs like any kernel. Up to ``one_shot_max_bytes`` every rank sums the whole
tensor (one-shot); above, rank r sums chunk r and pushes it back (two-shot, which moves fewer bytes per GPU from
4 ranks on); above ``max_bytes`` (prefill-sized messages) NCCL runs as before.

``parallel.custom_all_reduce``: ``auto`` (default) uses it where every rank can (CUDA, one node, peer access
between the GPUs, a world size of 2, 4, 6 or 8, symmetric memory available) and NCCL otherwise, logging why;
``true`` requires it (start-up fails with the reason); ``false`` keeps NCCL everywhere. The decision is made by
all ranks together, so they never disagree about which collective a call runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from treadle.core.distributed.parallel import get_tp_group, install_custom_all_reduce, tp_gather_objects

logger = logging.getLogger(__name__)

ONE_SHOT, TWO_SHOT, NCCL = "one_shot", "two_shot", "nccl"
SUPPORTED_WORLD_SIZES = (2, 4, 6, 8)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MiB = 1 << 20


@dataclass(frozen=True)
class AllReducePlan:
    """Which algorithm a message of a given size takes on ``world_size`` ranks."""

    world_size: int
    one_shot_max_bytes: int
    max_bytes: int

    def algorithm(self, nbytes: int) -> str:
        if nbytes > self.max_bytes:
            return NCCL
        return ONE_SHOT if nbytes <= self.one_shot_max_bytes else TWO_SHOT

    @classmethod
    def for_world(cls, world_size: int, max_bytes: int = 8 * _MiB) -> "AllReducePlan":
        # At 2 ranks both algorithms move the same bytes per GPU and two-shot adds a flag exchange; from 4
        # ranks one-shot's (W-1)·n bytes in per GPU outgrow two-shot's 2(W-1)·n/W once the message is large.
        one_shot = max_bytes if world_size == 2 else (512 * 1024 if world_size == 4 else 256 * 1024)
        return cls(world_size, min(one_shot, max_bytes), max_bytes)


@dataclass(frozen=True)
class PeerBufferLayout:
    """Byte layout of one rank's buffer: flags ``[2][world][programs]`` int64, then ``[2][world]`` slots."""

    world_size: int
    programs: int
    slot_bytes: int

    @property
    def flag_bytes(self) -> int:
        return _round_up(2 * self.world_size * self.programs * 8, 256)

    @property
    def total_bytes(self) -> int:
        return self.flag_bytes + 2 * self.world_size * self.slot_bytes

    def slot_elems(self, dtype: torch.dtype) -> int:
        return self.slot_bytes // _element_size(dtype)


def slices_per_row(rows: int, block: int, most: int, programs: int) -> int:
    """Programs sharing each row of the fused all-reduce + norm, for rows of ``block`` (a power of two) elements:
    rows of 8192 or more in slices of 2048, at most ``most`` of them, every row a group of its own among
    ``programs``. On 4 x H200 one row of 8192 added 3.7 us to a layer's GEMV in 4 slices against 6.4 whole (8
    slices: 3.9 us); rows of 4096 gained nothing from slices (``bench tp_decode``)."""
    split = 1
    while block >= 8192 and block // (split * 2) >= 2048 and split * 2 <= most and rows * split * 2 <= programs:
        split *= 2
    return split


def unsupported_reason(device: torch.device, world_size: int, nnodes: int,
                       peer_access: Callable[[int, int], bool] | None = None,
                       local_devices: list[int] | None = None) -> str | None:
    """Why this rank cannot run the peer all-reduce (None: it can). ``peer_access(a, b)``: can device a read and
    write device b's memory (``torch.cuda.can_device_access_peer``); ``local_devices``: the group's devices."""
    if device.type != "cuda":
        return f"the ranks run on {device.type}, not CUDA"
    if nnodes > 1:
        return f"the group spans {nnodes} nodes (peer memory is within one node)"
    if world_size not in SUPPORTED_WORLD_SIZES:
        return f"tp_size {world_size} is not one of {', '.join(map(str, SUPPORTED_WORLD_SIZES))}"
    if not _symmetric_memory_available():
        return "torch.distributed._symmetric_memory is not available in this torch build"
    peer_access = peer_access or torch.cuda.can_device_access_peer
    me = device.index if device.index is not None else torch.cuda.current_device()
    for other in local_devices or []:
        if other != me and not peer_access(me, other):
            return f"GPU {me} has no peer access to GPU {other} (no NVLink or P2P over PCIe)"
    return None


def agreed_reason(reasons: list[str | None]) -> str | None:
    """The first rank's reason not to run, over all ranks' (None only when every rank can)."""
    for rank, reason in enumerate(reasons):
        if reason is not None:
            return f"rank {rank}: {reason}"
    return None


def setup_custom_all_reduce(mode: bool | str, device: torch.device, nnodes: int,
                            local_devices: list[int] | None = None) -> "CustomAllReduce | None":
    """Every rank calls this once after joining the group; installs the peer all-reduce where all ranks can.

    ``mode`` is ``parallel.custom_all_reduce``. Returns the installed object, or None (NCCL everywhere).
    """
    group = get_tp_group()
    if mode is False or group.size == 1:
        return None
    reports = tp_gather_objects((unsupported_reason(device, group.size, nnodes, local_devices=local_devices),
                                 _rendezvous_made))
    reason = agreed_reason([why for why, _ in reports]) or _rendezvous_counts_disagree([n for _, n in reports])
    fast = None
    if reason is None:
        fast, failure = _try_build(group, device)
        # Also the barrier after which every rank's flags are zero: no rank pushes before all have set up.
        builds = tp_gather_objects((failure, getattr(fast, "offset", None)))
        reason = agreed_reason([f for f, _ in builds]) or _offsets_disagree([o for _, o in builds])
    if reason is not None:
        if fast is not None:
            fast.close()
        if mode is True:
            raise RuntimeError(f"parallel.custom_all_reduce is true but the peer all-reduce cannot run: {reason}; "
                               "set it to auto (NCCL where it cannot) or false")
        if device.type == "cuda":
            logger.info("all-reduce: NCCL only (%s)", reason)
        return None
    install_custom_all_reduce(fast)
    logger.info("all-reduce: %s", fast.describe())
    return fast


# Symmetric-memory rendezvous this process has made (setup_custom_all_reduce compares it across the ranks).
_rendezvous_made = 0


class CustomAllReduce:
    """The peer all-reduce of one rank: ``handles(x)`` says whether a tensor takes it, ``self(x)`` sums ``x`` over
    the ranks in place (same contract as ``tp_all_reduce``).

    ``buffer`` is this rank's buffer (``layout.total_bytes``, zeroed here) and ``bases`` every rank's buffer address
    as mapped in this process, in rank order: :meth:`over_symmetric_memory` on GPUs; the CPU tests map files.
    """

    PROGRAMS = 32
    ROW_SPLIT = 8
    BLOCK = 2048
    NUM_WARPS = 8
    MAX_SPINS = 1 << 30  # minutes of waiting: a peer that never comes is a bug, reported in `errors`

    def __init__(self, rank: int, world_size: int, buffer: torch.Tensor, bases: list[int],
                 plan: AllReducePlan | None = None, keepalive: Any = None) -> None:
        self.rank, self.world_size, self.device = rank, world_size, buffer.device
        self.plan = plan or AllReducePlan.for_world(world_size)
        self.layout = PeerBufferLayout(world_size, self.PROGRAMS, self.plan.max_bytes)
        if buffer.numel() < self.layout.total_bytes or bases[rank] != buffer.data_ptr():
            raise ValueError(f"rank {rank}'s buffer ({buffer.numel()} bytes at {buffer.data_ptr():#x}) is not the "
                             f"{self.layout.total_bytes} bytes at {bases[rank]:#x} its peers see")
        self.buffer, self.keepalive, self.offset = buffer, keepalive, 0
        self._pdl = _pdl_launch(self.device)
        self.bases = torch.tensor(bases, dtype=torch.int64, device=self.device)
        self.epochs = torch.zeros(self.PROGRAMS, dtype=torch.int64, device=self.device)
        self.errors = torch.zeros(1, dtype=torch.int32, device=self.device)
        # At most this many programs share a row of the fused all-reduce + norm (slices_per_row; TREADLE_AR_SPLIT
        # for A/B runs); 1 where the kernels are interpreted: their programs run one after another, and a row's
        # programs wait for each other.
        self.row_split = int(os.environ.get("TREADLE_AR_SPLIT", self.ROW_SPLIT)) if self.device.type == "cuda" else 1
        self.buffer.zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @classmethod
    def over_symmetric_memory(cls, rank: int, world_size: int, device: torch.device, process_group: Any,
                              plan: AllReducePlan | None = None) -> "CustomAllReduce":
        """Buffers from torch's symmetric memory (CUDA backend, multicast off), exchanged over ``process_group``."""
        from torch.distributed import _symmetric_memory as symm_mem

        plan = plan or AllReducePlan.for_world(world_size)
        total = PeerBufferLayout(world_size, cls.PROGRAMS, plan.max_bytes).total_bytes
        _keep_multicast_off()
        with contextlib.suppress(Exception):  # the CUDA backend unless another was chosen before
            symm_mem.set_backend("CUDA")
        buffer = symm_mem.empty(total, dtype=torch.uint8, device=device)
        with contextlib.suppress(Exception):  # needed by older torch releases, a no-op where it is not
            symm_mem.enable_symm_mem_for_group(process_group.group_name)
        global _rendezvous_made
        _rendezvous_made += 1  # counted even if it fails part-way: a later group then keeps to NCCL
        handle = symm_mem.rendezvous(buffer, process_group.group_name)  # a name: every torch release takes it
        # The tensor may sit inside a larger symmetric allocation, at the same offset on every rank (checked by
        # setup_custom_all_reduce across the ranks).
        offset = buffer.data_ptr() - int(handle.buffer_ptrs[rank])
        if not 0 <= offset < int(getattr(handle, "buffer_size", offset + 1)):
            raise RuntimeError(f"symmetric buffer at {buffer.data_ptr():#x} lies outside its allocation at "
                               f"{int(handle.buffer_ptrs[rank]):#x}")
        fast = cls(rank, world_size, buffer, [int(ptr) + offset for ptr in handle.buffer_ptrs], plan, handle)
        fast.offset = offset
        return fast

    def handles(self, x: torch.Tensor) -> bool:
        return (x.dtype in SUPPORTED_DTYPES and x.device.type == self.device.type and x.is_contiguous()
                and x.numel() * x.element_size() <= self.plan.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(x, self.plan.algorithm(x.numel() * x.element_size()))

    def reduce(self, x: torch.Tensor, algorithm: str) -> torch.Tensor:
        """``x`` summed over the ranks in place by ``algorithm`` (ONE_SHOT or TWO_SHOT); every rank must pass the
        same. ``self(x)`` picks it from the plan."""
        from treadle.kernels.peer_all_reduce import one_shot_all_reduce_kernel, two_shot_all_reduce_kernel

        n = x.numel()
        if n == 0:
            return x
        kernel = one_shot_all_reduce_kernel if algorithm == ONE_SHOT else two_shot_all_reduce_kernel
        kernel[(self.PROGRAMS,)](
            x, n, self.bases, self.epochs, self.errors, RANK=self.rank, WORLD=self.world_size,
            PROGRAMS=self.PROGRAMS, BLOCK=self.BLOCK, FLAG_BYTES=self.layout.flag_bytes,
            SLOT_ELEMS=self.layout.slot_elems(x.dtype), MAX_SPINS=self.MAX_SPINS, num_warps=self.NUM_WARPS,
            **self._launch_args())
        return x

    def handles_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether :meth:`all_reduce_add_rmsnorm` takes ``x`` (2-D rows, a one-shot size, at most 4 rows a
        program: decode batches; larger ones run the all-reduce and the norm apart)."""
        return (x.dim() == 2 and self.handles(x) and residual.shape == x.shape and residual.is_contiguous()
                and residual.dtype == x.dtype and x.shape[0] <= 4 * self.PROGRAMS
                and self.plan.algorithm(x.numel() * x.element_size()) == ONE_SHOT)

    def all_reduce_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_rmsnorm(all_reduce(x), residual, weight, eps)`` in one kernel: ``(normed, x + residual)`` with
        ``x`` summed over the ranks (``x`` itself is left as it was)."""
        from treadle.kernels.peer_all_reduce import one_shot_all_reduce_add_rmsnorm_kernel

        rows, cols = x.shape
        out, residual_out = torch.empty_like(x), torch.empty_like(x)
        block = 1 << (cols - 1).bit_length()
        one_shot_all_reduce_add_rmsnorm_kernel[(self.PROGRAMS,)](
            x, residual, weight, out, residual_out, rows, cols, eps, self.bases, self.epochs, self.errors,
            RANK=self.rank, WORLD=self.world_size, PROGRAMS=self.PROGRAMS, BLOCK=block,
            FLAG_BYTES=self.layout.flag_bytes, SLOT_ELEMS=self.layout.slot_elems(x.dtype), MAX_SPINS=self.MAX_SPINS,
            SPLIT=slices_per_row(rows, block, self.row_split, self.PROGRAMS),
            num_warps=min(16, max(1, block // 256)),  # add_rmsnorm's layout: the same sums, bit for bit
            **self._launch_args())
        return out, residual_out

    def _launch_args(self) -> dict[str, bool]:
        return {"PDL": self._pdl, "GO_AHEAD": self._pdl, "launch_pdl": self._pdl}

    def error_count(self) -> int:
        """Waits that gave up so far (a host sync: tests and diagnostics only)."""
        return int(self.errors.item())

    def describe(self) -> str:
        return (f"peer-to-peer on {self.world_size} GPUs: one-shot up to {self.plan.one_shot_max_bytes // 1024} KiB, "
                f"two-shot up to {self.plan.max_bytes // 1024} KiB, NCCL above")

    def close(self) -> None:
        if get_tp_group().custom_all_reduce is self:
            install_custom_all_reduce(None)
        self.keepalive = None
        self.buffer = None


def _pdl_launch(device: torch.device) -> bool:
    """Whether the kernels launch with PDL and the early go-ahead (kernels/peer_all_reduce.py): where the GPU has
    PDL; ``TREADLE_AR_PDL=0`` launches them stream-ordered, for A/B runs."""
    if device.type != "cuda":
        return False
    from treadle.kernels.pdl import enabled

    return enabled(device) and os.environ.get("TREADLE_AR_PDL") != "0"


def _try_build(group: Any, device: torch.device) -> tuple[CustomAllReduce | None, str | None]:
    try:
        return CustomAllReduce.over_symmetric_memory(group.rank, group.size, device, group.device_group), None
    except Exception as exc:  # any failure here means NCCL, said in the log, never a crash or a hang
        return None, f"setting up peer buffers failed: {type(exc).__name__}: {exc}"


def _rendezvous_counts_disagree(counts: list[int]) -> str | None:
    """Why ranks that have made different numbers of symmetric-memory rendezvous in their processes cannot set up
    peer buffers together: torch numbers its store exchanges per process, so each would wait for the other's key
    forever (an Engine started after another in the same process, beside freshly started ranks)."""
    if len(set(counts)) > 1:
        return (f"the ranks' processes set up peer buffers for earlier groups {counts} times (a tensor-parallel "
                "engine started after another in this process), and torch's symmetric memory numbers its exchanges "
                "per process: they would wait for each other")
    return None


def _offsets_disagree(offsets: list[int]) -> str | None:
    if len(set(offsets)) > 1:
        return f"the ranks' buffers sit at different offsets of their symmetric allocations ({offsets})"
    return None


def _keep_multicast_off() -> None:
    # torch's CUDA symmetric memory would also create an NVLink multicast object where the driver offers one;
    # these machines must not use multicast, and the kernels never need it.
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"


def _symmetric_memory_available() -> bool:
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
