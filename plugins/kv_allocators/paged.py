"""The ``paged`` KV allocator: page size N, positions ``kN .. kN+N-1`` of a request share one page."""

from __future__ import annotations

import torch

from treadle.core.hookspecs import hookimpl
from treadle.core.memory.allocator import KVAllocator


class PagedKVAllocator(KVAllocator):
    """Hands out whole pages from a free list; page 0 (slots ``[0, page_size)``) is padding.

    Page ``p`` holds slots ``[p * page_size, (p + 1) * page_size)``, and a
    position's slot always sits at offset ``position % page_size`` of its
    page, so attention backends can address KV by page. ``alloc_extend``
    first fills the rest of a request's partly used last page (after
    ``last_slots[i]``) and takes fresh pages only at page boundaries.
    """

    def __init__(self, size: int, page_size: int, device: torch.device | str = "cpu") -> None:
        super().__init__(size, page_size, device)
        self.num_pages = self.size // page_size
        self.clear()

    @property
    def free_slots(self) -> int:
        return int(self._free_pages.numel()) * self.page_size

    def alloc_extend(
        self, prefix_lens: list[int], extend_lens: list[int], last_slots: list[int]
    ) -> torch.Tensor | None:
        self.check_alloc_args(prefix_lens, extend_lens, last_slots)
        page = self.page_size
        prefix = torch.tensor(prefix_lens, dtype=torch.int64)
        extend = torch.tensor(extend_lens, dtype=torch.int64)
        last = torch.tensor(last_slots, dtype=torch.int64)
        # Tokens that fit in the partly filled last page, then whole fresh pages.
        continued = torch.minimum((-prefix) % page, extend)
        fresh_pages = (extend - continued + page - 1) // page
        _check_continuation(prefix, last, continued, page)
        num_new_pages = int(fresh_pages.sum())
        if num_new_pages > self._free_pages.numel():
            return None

        new_pages = self._free_pages[:num_new_pages]
        self._free_pages = self._free_pages[num_new_pages:]
        self._is_free[new_pages] = False

        # Per token: its request and its offset within that request's new tokens.
        num_tokens = int(extend.sum())
        token_end = torch.cumsum(extend, 0)
        token_start = token_end - extend
        # searchsorted, not repeat_interleave: the latter forks OpenMP threads for any size (ms when CPUs are busy).
        req_of_token = torch.searchsorted(token_end, torch.arange(num_tokens), right=True)
        offset = torch.arange(num_tokens, dtype=torch.int64) - token_start[req_of_token]
        continued_of_token = continued[req_of_token]

        in_last_page = offset < continued_of_token
        fresh_offset = (offset - continued_of_token).clamp_min(0)
        page_start = torch.cumsum(fresh_pages, 0) - fresh_pages
        page_index = (page_start[req_of_token] + fresh_offset // page).clamp_max(max(num_new_pages - 1, 0))
        fresh_slots = new_pages[page_index] * page + fresh_offset % page if num_new_pages else fresh_offset
        return torch.where(in_last_page, last[req_of_token] + 1 + offset, fresh_slots)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        pages = torch.unique(slots.to(device="cpu", dtype=torch.int64) // self.page_size)
        low, high = int(pages[0]), int(pages[-1])
        if low < 1 or high > self.num_pages:
            raise ValueError(
                f"cannot free pages outside [1, {self.num_pages}] (page 0 is padding): got pages [{low}, {high}]"
            )
        if self._is_free[pages].any():
            raise ValueError("double free: some of the given KV slots lie in pages that are already free")
        self._is_free[pages] = True
        self._free_pages = torch.cat([self._free_pages, pages])

    def clear(self) -> None:
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        # Indexed by page; guards the accounting against double frees.
        self._is_free = torch.ones(self.num_pages + 1, dtype=torch.bool)
        self._is_free[0] = False


def _check_continuation(prefix: torch.Tensor, last: torch.Tensor, continued: torch.Tensor, page: int) -> None:
    """A partly filled page is continued from ``last_slots``; it must be the slot of position prefix - 1."""
    continuing = continued > 0
    if not bool(continuing.any()):
        return
    wrong = continuing & ((last < page) | (last % page != (prefix - 1) % page))
    if bool(wrong.any()):
        i = int(wrong.nonzero()[0])
        raise ValueError(
            f"request {i}: prefix_len {int(prefix[i])} ends inside a page, so last_slots[{i}] must be the slot of "
            f"position {int(prefix[i]) - 1} (page offset {(int(prefix[i]) - 1) % page}), got {int(last[i])}"
        )


@hookimpl
def treadle_register_kv_allocators(register) -> None:
    register("paged", PagedKVAllocator)
