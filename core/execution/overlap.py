"""Device-side pieces of overlap scheduling: host-to-device copies that do not block, the per-request
next-input-token buffer, and a step's results copied back to the host in the background.

Nothing here synchronizes the device: host tensors bound for CUDA go through pinned memory with
``non_blocking=True``; results come back into pinned memory behind a CUDA event that the host waits on
only when it needs the values, one step later. On the CPU every copy is a no-op and no CUDA API is called.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from treadle.core.execution.forward_batch import ForwardBatch
    from treadle.core.scheduling.schedule_batch import ScheduleBatch
    from treadle.core.speculative.tree import TreeLayout


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without waiting for the device (pinned staging on CUDA)."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def to_device_packed(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host integer arrays on ``device`` as int64 tensors of their shapes, moved in one copy: a step's handful of
    small index tensors cost one transfer instead of one pinned allocation and copy each (~25 µs of host time per
    pinned copy on an H100 host, on the path between a verify step's results and the next step's launch). On CUDA
    they are packed straight into a preallocated pinned buffer (:class:`PinnedStaging`)."""
    arrays = [array if type(array) is np.ndarray and array.dtype == np.int64 else np.asarray(array, dtype=np.int64)
              for array in arrays]
    flat = [array if array.ndim == 1 else array.reshape(-1) for array in arrays]
    if device.type == "cuda":
        moved = _staging(device).copy(flat)
    else:
        moved = torch.from_numpy(np.concatenate(flat))
    # One split (a single operator) rather than a slice per array: this runs on the verify critical path.
    tensors = list(moved.split_with_sizes([array.size for array in arrays])) if len(arrays) > 1 else [moved]
    for i, array in enumerate(arrays):
        if array.ndim != 1:
            tensors[i] = tensors[i].view(array.shape)
    return tensors


class PinnedStaging:
    """A ring of preallocated pinned int64 buffers for host-to-device copies. A buffer is written again only once
    the copy out of it has finished (its CUDA event, asked without waiting); while it has not, or for more than a
    buffer holds, the copy takes a fresh pinned tensor as :func:`to_device` does."""

    def __init__(self, device: torch.device, buffers: int = 8, size: int = 16384) -> None:
        self.device = device
        self.buffers = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(buffers)]
        self.events: list[torch.cuda.Event | None] = [None] * buffers
        self.next = 0

    def copy(self, parts: Sequence[np.ndarray]) -> torch.Tensor:
        """``parts`` (int64) end to end on the device, as one int64 tensor."""
        total = sum(part.size for part in parts)
        slot = self.next
        event = self.events[slot]
        if total > self.buffers[slot].numel() or (event is not None and not event.query()):
            return to_device(torch.from_numpy(np.concatenate(parts)), self.device)
        host = self.buffers[slot][:total]
        np.concatenate(parts, out=host.numpy())
        moved = host.to(self.device, non_blocking=True)
        if event is None:
            event = self.events[slot] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # the stream the copy was queued on
        self.next = (slot + 1) % len(self.buffers)
        return moved


_stagings: dict[torch.device, PinnedStaging] = {}


def _staging(device: torch.device) -> PinnedStaging:
    if device not in _stagings:
        _stagings[device] = PinnedStaging(device)
    return _stagings[device]


class NextInputIds:
    """The last sampled token of every request-table row, on the device.

    After each sampling the step's tokens are scattered here by ``req_pool_idx``; the next step
    gathers its decode rows' input ids from here, so a token never has to visit the host before
    it is fed back to the model. A verify step of ``k + 1`` tokens per request records the token
    that follows its accepted drafts (``record_accepted``).
    """

    def __init__(self, rows: int, device: torch.device) -> None:
        self.ids = torch.zeros(rows, dtype=torch.int64, device=device)

    def record(self, req_pool_indices: torch.Tensor, next_token_ids: torch.Tensor) -> None:
        self.ids.index_copy_(0, req_pool_indices, next_token_ids)

    def record_accepted(self, req_pool_indices: torch.Tensor, token_ids: torch.Tensor,
                        accepted: torch.Tensor) -> None:
        """``token_ids``: ``[bs, k + 1]`` the step's tokens at each position; ``accepted``: ``[bs]`` how many
        drafts each request kept, so its next input is ``token_ids[i, accepted[i]]`` (on the device)."""
        self.record(req_pool_indices, token_ids.gather(1, accepted.unsqueeze(1)).squeeze(1))

    def gather(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        return self.ids.index_select(0, req_pool_indices)


class HostCopy:
    """Device tensors on their way to the host; ``wait()`` returns them once the copy has finished."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self._event = None
        self._values: dict[str, Any] = {}
        on_cuda = False
        for name, value in tensors.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                # A non-blocking device-to-host to() allocates a pinned destination.
                value = value.to("cpu", non_blocking=True)
                on_cuda = True
            self._values[name] = value
        if on_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    @property
    def waited(self) -> bool:
        """Whether the values are on the host already: :meth:`wait` returned once, or nothing was on a device.
        Never asks the device, so every tensor-parallel rank sees the same answer at the same point."""
        return self._event is None

    def wait(self) -> dict[str, Any]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._values


@dataclass
class LaunchedStep:
    """One step whose forward (and then sampling) was queued on the device; the host reads it later."""

    batch: "ScheduleBatch"
    forward_batch: "ForwardBatch"
    logits: torch.Tensor | None  # dropped once sampling has been queued
    results: HostCopy | None = None  # the sampled ids (and log-probs) on their way to the host
    draft_ids: torch.Tensor | None = None  # a TARGET_VERIFY step's drafts, [bs, k] on the device
    # The same drafts on their way to the host ("ids"), copied before the target's forward was queued: what a
    # constrained request's masks are built from (None: no request of the step is constrained).
    host_draft_ids: HostCopy | None = None
    # The distributions the drafts were sampled from, [bs, k, vocab] float32 (None: deterministic drafts).
    draft_probs: torch.Tensor | None = None
    pooled: torch.Tensor | None = None  # an embedding step's pooled parts, [bs, hidden] on the device
    # A TARGET_VERIFY step over draft trees: their layout (core/speculative/tree.py); None for chains.
    tree: "TreeLayout | None" = None
    # Its kept drafts then the target's token, [bs, t] on the device, once its sampling is queued (drafters that
    # catch up on the kept path read them).
    kept_ids: torch.Tensor | None = None
    # And the kept path's node at each depth, [bs, t] (core/speculative/tree.py): whose K/V moves into place.
    kept_path: torch.Tensor | None = None
    # A verify step's accepted draft counts, [bs] int64 on the device, once its sampling is queued: what an
    # overlapped verify step queued before they reach the host places its tokens by.
    accepted: torch.Tensor | None = None
    # The overlapped verify batch queued after this step before its results were read (ScheduleBatch.follows).
    followed_by: "ScheduleBatch | None" = None
