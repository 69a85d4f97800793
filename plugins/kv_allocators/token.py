"""The ``token`` KV allocator: page size 1, any free slot serves any position."""

from __future__ import annotations

import numpy as np
import torch

from treadle.core.hookspecs import hookimpl
from treadle.core.memory.allocator import KVAllocator


class TokenKVAllocator(KVAllocator):
    """Hands out single KV slots from a free queue; slot 0 is padding.

    The free slots sit in a ring of ``size`` entries: allocation takes them from its head and ``free`` appends
    them at its tail, so one call costs a copy of the slots it takes or gives back, whatever the pool's size
    (a concatenation onto the whole free list cost a copy of every free slot: a draft tree verify step gives back
    its rejected slots every step). The ring and the free flags are numpy arrays: a verify step allocates and gives
    back a handful of slots between its results and the next launch, where each torch operator on a tiny host
    tensor costs several times its numpy counterpart.
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
        return self._count

    def alloc_extend(
        self, prefix_lens: list[int], extend_lens: list[int], last_slots: list[int]
    ) -> torch.Tensor | None:
        self.check_alloc_args(prefix_lens, extend_lens, last_slots)
        need = sum(extend_lens)
        if need > self._count:
            return None
        start, end = self._head, self._head + need
        if end <= self.size:
            slots = self._ring[start:end].copy()
        else:
            slots = np.concatenate([self._ring[start:], self._ring[:end - self.size]])
        self._head = end % self.size
        self._count -= need
        self._is_free[slots] = False
        return torch.from_numpy(slots)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        freed = slots.to(device="cpu", dtype=torch.int64).reshape(-1).numpy()
        _check_owned(freed, self._is_free, 1, self.size)
        self._is_free[freed] = True
        tail = (self._head + self._count) % self.size
        count = freed.size
        first = min(count, self.size - tail)
        self._ring[tail:tail + first] = freed[:first]
        if first < count:  # wrapped round
            self._ring[:count - first] = freed[first:]
        self._count += count

    def clear(self) -> None:
        self._ring = np.arange(1, self.size + 1, dtype=np.int64)
        self._head = 0  # the ring's first free slot
        self._count = self.size
        # Indexed by slot; guards the accounting against double frees.
        self._is_free = np.ones(self.size + 1, dtype=np.bool_)
        self._is_free[0] = False


def _check_owned(units: np.ndarray, is_free: np.ndarray, first: int, count: int) -> None:
    """Refuse to free padding, out-of-range or already free slots (that would corrupt the counts)."""
    if units.size <= 64:  # a verify step's few rejected slots: plain Python is quickest
        values = units.tolist()
        low, high, repeated = min(values), max(values), len(set(values)) != len(values)
    else:
        low, high = int(units.min()), int(units.max())
        repeated = bool((np.diff(np.sort(units)) == 0).any())  # several times faster than np.unique
    if low < first or high >= first + count:
        raise ValueError(f"cannot free slot/page outside [{first}, {first + count}): got range [{low}, {high}]")
    if repeated or is_free[units].any():
        raise ValueError("double free: some of the given KV slots are already free (or repeated)")


@hookimpl
def treadle_register_kv_allocators(register) -> None:
    register("token", TokenKVAllocator)
