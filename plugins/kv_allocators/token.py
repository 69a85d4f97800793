"""The ``token`` KV allocator: page size 1, any free slot serves any position."""

from __future__ import annotations

import torch

from treadle.core.hookspecs import hookimpl
from treadle.core.memory.allocator import KVAllocator


class TokenKVAllocator(KVAllocator):
    """Hands out single KV slots from a free stack; slot 0 is padding.

    Allocation takes slots from the front of the free tensor and ``free``
    appends them back, so one call costs a slice or a concatenation whatever
    the number of tokens.
    """

    def __init__(self, size: int, page_size: int = 1, device: torch.device | str = "cpu") -> None:
        if page_size != 1:
            raise ValueError(
                f"kv_allocator 'token' has page size 1, got page_size={page_size}; use kv_allocator 'paged'"
            )
        super().__init__(size, page_size, device)
        self.clear()

    @property
    def free_slots(self) -> int:
        return int(self._free.numel())

    def alloc_extend(
        self, prefix_lens: list[int], extend_lens: list[int], last_slots: list[int]
    ) -> torch.Tensor | None:
        self.check_alloc_args(prefix_lens, extend_lens, last_slots)
        need = sum(extend_lens)
        if need > self._free.numel():
            return None
        slots = self._free[:need]
        self._free = self._free[need:]
        self._is_free[slots] = False
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        slots = slots.to(device="cpu", dtype=torch.int64).flatten()
        _check_owned(slots, self._is_free, 1, self.size)
        self._is_free[slots] = True
        self._free = torch.cat([self._free, slots])

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)
        # Indexed by slot; guards the accounting against double frees.
        self._is_free = torch.ones(self.size + 1, dtype=torch.bool)
        self._is_free[0] = False


def _check_owned(units: torch.Tensor, is_free: torch.Tensor, first: int, count: int) -> None:
    """Refuse to free padding, out-of-range or already free slots/pages (that would corrupt the counts)."""
    low, high = int(units.min()), int(units.max())
    if low < first or high >= first + count:
        raise ValueError(f"cannot free slot/page outside [{first}, {first + count}): got range [{low}, {high}]")
    if is_free[units].any() or torch.unique(units).numel() != units.numel():
        raise ValueError("double free: some of the given KV slots are already free (or repeated)")


@hookimpl
def treadle_register_kv_allocators(register) -> None:
    register("token", TokenKVAllocator)
