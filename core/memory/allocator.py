"""The KVAllocator interface: hands out KV slots at token or page granularity."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class KVAllocator(ABC):
    """Owns the free KV slots ``[page_size, page_size + size)``; slots below are padding.

    Built by its registered factory as ``factory(size, page_size, device)``.
    Slots are host-side int64 tensors; the scheduler moves them to the device.
    A request's positions map to slots so that, with page size P, positions
    ``kP .. kP+P-1`` of one request share one page: ``alloc_extend`` continues a
    partly filled last page (given its last slot) before taking fresh pages.

    A request may also shrink: after a verify step the scheduler gives back the
    slots of the positions it rejected, whole pages only (those past the page of
    its last kept position), and later continues that partly filled page from
    its last kept slot, whose following slots it still holds.
    """

    def __init__(self, size: int, page_size: int, device: torch.device | str = "cpu") -> None:
        if size < page_size:
            raise ValueError(f"KV pool of {size} slots is smaller than one page of {page_size}")
        self.size = size - size % page_size
        self.page_size = page_size
        self.device = torch.device(device)

    @property
    def total_slots(self) -> int:
        return self.size

    @property
    @abstractmethod
    def free_slots(self) -> int:
        """Slots that can be handed out now (whole free pages × page size)."""

    @abstractmethod
    def alloc_extend(
        self, prefix_lens: list[int], extend_lens: list[int], last_slots: list[int]
    ) -> torch.Tensor | None:
        """Slots for positions ``[prefix_lens[i], prefix_lens[i] + extend_lens[i])`` of each request,
        concatenated in request order; ``last_slots[i]`` is the slot of position
        ``prefix_lens[i] - 1`` (-1 when the prefix is empty, and always -1 with page size 1,
        where no page is partly filled). None, allocating nothing, when memory is short."""

    @abstractmethod
    def free(self, slots: torch.Tensor) -> None:
        """Give back slots (paged: the pages containing them, which the caller owns whole): a finished request's,
        or a request's positions from some length on (its tail pages, see the class docstring)."""

    @abstractmethod
    def clear(self) -> None:
        """Make every slot free again."""

    @staticmethod
    def check_alloc_args(prefix_lens: list[int], extend_lens: list[int], last_slots: list[int]) -> None:
        """Raise ValueError unless the three lists are one entry per request with extend_lens >= 0."""
        if not (len(prefix_lens) == len(extend_lens) == len(last_slots)):
            raise ValueError(
                f"alloc_extend needs one prefix_len, extend_len and last_slot per request, got "
                f"{len(prefix_lens)}, {len(extend_lens)} and {len(last_slots)}"
            )
        if extend_lens and min(extend_lens) < 0:
            raise ValueError(f"extend_lens must be >= 0, got {list(extend_lens)}")

    def alloc_decode(self, seq_lens: list[int], last_slots: list[int]) -> torch.Tensor | None:
        """One slot per request for position ``seq_lens[i]`` (the token being decoded)."""
        return self.alloc_extend(seq_lens, [1] * len(seq_lens), last_slots)

    def slots_needed(self, prefix_len: int, extend_len: int) -> int:
        """Worst-case free slots consumed by extending one request (page-rounded)."""
        if self.page_size == 1:
            return extend_len
        first_page_room = (-prefix_len) % self.page_size
        rest = max(0, extend_len - first_page_room)
        return -(-rest // self.page_size) * self.page_size
