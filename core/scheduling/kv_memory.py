"""The scheduler's KV memory bookkeeping: slots for a batch (evicting cached prefixes when short), a request's
slots and table row handed back, a prefilled prompt shared into the prefix cache.

It knows requests only by their KV fields (``kv_slots``, ``req_pool_idx``, ``last_node``, ``prefix_len``);
which queue a request is in is ``RequestLifecycle``'s business.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from treadle.core.execution.batch_context import NO_ADAPTER
from treadle.core.execution.overlap import to_device
from treadle.core.memory.radix_cache import NoPrefixCache, PrefixCache, RadixCache
from treadle.core.request import Req

if TYPE_CHECKING:
    from treadle.core.execution.worker import WorkerInfo
    from treadle.core.lora.manager import LoRAManager
    from treadle.core.scheduling.schedule_batch import BatchEntry

EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)


class KVMemory:
    """The KV allocator, the request-to-token table and the prefix cache, as the scheduler uses them."""

    def __init__(self, allocator, req_to_token_pool, tree_cache: PrefixCache, page_size: int,
                 lora: "LoRAManager | None" = None) -> None:
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.tree_cache = tree_cache
        self.page_size = page_size
        self.lora = lora  # an admitted request also holds its adapter's device slot (None: LoRA is off)

    @classmethod
    def for_worker(cls, info: "WorkerInfo", disable_radix_cache: bool) -> "KVMemory":
        """The worker's pools, with a radix prefix cache over them (or none: ``cache.disable_radix_cache``)."""
        tree_cache = (NoPrefixCache(info.allocator) if disable_radix_cache
                      else RadixCache(info.allocator, info.page_size))
        return cls(info.allocator, info.req_to_token_pool, tree_cache, info.page_size, info.lora)

    @property
    def caches_prefixes(self) -> bool:
        return not isinstance(self.tree_cache, NoPrefixCache)

    def available(self) -> int:
        """Slots a batch can get: the free ones and the cached ones nobody uses (evicted on demand)."""
        return self.allocator.free_slots + self.tree_cache.evictable_size()

    # ------------------------------------------------------------------ a batch's slots

    def alloc_extend(self, entries: list["BatchEntry"]) -> torch.Tensor | None:
        """Slots for every entry's ``[kv_start, kv_start + extend_len)``, in entry order (None: too few)."""
        need = sum(self.allocator.slots_needed(e.kv_start, e.extend_len) for e in entries)
        return self._alloc(lambda: self.allocator.alloc_extend(
            [e.kv_start for e in entries], [e.extend_len for e in entries], self.last_slots([e.req for e in entries])),
            need)

    def decode_slots_needed(self, reqs: list[Req], tokens_per_req: int = 1) -> int:
        """Free slots a decode step of ``tokens_per_req`` new tokens per request consumes (page-rounded)."""
        # Page size 1: one slot a token (the common case, skipping a call per request).
        if self.page_size == 1:
            return len(reqs) * tokens_per_req
        return sum(self.allocator.slots_needed(req.kv_len, tokens_per_req) for req in reqs)

    def alloc_decode(self, reqs: list[Req], kv_lens: list[int], need: int) -> torch.Tensor | None:
        """One slot for each request's next position ``kv_lens[i]`` (``need``: ``decode_slots_needed(reqs)``)."""
        return self._alloc(lambda: self.allocator.alloc_decode(kv_lens, self.last_slots(reqs)), need)

    def alloc_verify(self, reqs: list[Req], kv_lens: list[int], tokens_per_req: int,
                     need: int) -> torch.Tensor | None:
        """``tokens_per_req`` slots for each request's positions from ``kv_lens[i]`` on, request after request
        (``need``: ``decode_slots_needed(reqs, tokens_per_req)``)."""
        return self._alloc(lambda: self.allocator.alloc_extend(kv_lens, [tokens_per_req] * len(reqs),
                                                               self.last_slots(reqs)), need)

    def _alloc(self, allocate: Callable[[], torch.Tensor | None], need: int) -> torch.Tensor | None:
        shortfall = need - self.allocator.free_slots
        if shortfall > 0:
            self.tree_cache.evict(shortfall)
        return allocate()

    def assign_slots(self, entries: list["BatchEntry"], slots: torch.Tensor) -> None:
        """Give each entry its share of ``slots`` and append them to its request's KV."""
        lengths = [entry.extend_len for entry in entries]
        values = slots.tolist() if 1 in lengths else []
        offset = 0
        for entry, new_slots in zip(entries, slots.split(lengths)):
            entry.new_slots = new_slots
            if entry.extend_len == 1:
                entry.req.append_kv_slot(values[offset])  # a decode row: no tensor op per request
            else:
                entry.req.kv_slots = torch.cat([entry.req.kv_slots, new_slots])
            offset += entry.extend_len

    def assign_verify_slots(self, entries: list["BatchEntry"], slots: torch.Tensor, tokens_per_req: int) -> None:
        """:meth:`assign_slots` for a verify step's rows (``tokens_per_req`` slots each), kept as ints on the
        request like a decode row's: no tensor op per request."""
        values = slots.tolist()
        if len(entries) == 1:  # the common verify batch: no split
            entries[0].new_slots = slots
            entries[0].req.extend_kv_slots(values)
            return
        for i, (entry, new_slots) in enumerate(zip(entries, slots.split(tokens_per_req))):
            entry.new_slots = new_slots
            entry.req.extend_kv_slots(values[i * tokens_per_req:(i + 1) * tokens_per_req])

    def last_slots(self, reqs: list[Req]) -> list[int]:
        """Each request's last KV slot, for the allocator to continue a partly filled page; with page
        size 1 no page is ever partly filled, so -1 (the contract of ``alloc_extend``) without reading them."""
        if self.page_size == 1:
            return [-1] * len(reqs)
        return [req.last_kv_slot for req in reqs]

    def drop_new_slots(self, entry: "BatchEntry") -> None:
        """Give back the slots a batch that never ran allocated for ``entry``; the request keeps what it had."""
        self.shorten([(entry.req, entry.kv_start)])

    def shorten(self, kept_lengths: list[tuple[Req, int]]) -> None:
        """Cut each request's KV to its first ``length`` positions and give back the slots past them (a verify
        step's rejected positions, a batch that never ran, tokens never read), in one ``free``.

        With pages of P slots the slots of positions up to the next page boundary stay the request's: they share
        the page of its last kept position, which the allocator continues (``alloc_extend``'s ``last_slots``) when
        the request grows again and frees whole when the request ends.
        """
        freed: list[int] = []
        page = self.page_size
        for req, length in kept_lengths:
            dropped = req.truncate_kv(length)
            if page > 1:
                dropped = dropped[(-length) % page:]
            freed.extend(dropped)
        if freed:
            self.allocator.free(torch.tensor(freed, dtype=torch.int64))

    def cut(self, spans: list[tuple[Req, int, int]]) -> None:
        """Take each request's KV positions ``[start, end)`` out of the middle of its slots and give them back (a
        verify step's rejected positions when the overlapped step after it already holds the slots past them), in
        one ``free``. Page size 1 only (overlapped verify steps need it)."""
        freed: list[int] = []
        for req, start, end in spans:
            freed.extend(req.cut_kv(start, end))
        if freed:
            self.allocator.free(torch.tensor(freed, dtype=torch.int64))

    # ------------------------------------------------------------------ a request's memory

    def take_row(self, req: Req, prefix_slots: torch.Tensor, prefix_len: int, node) -> None:
        """Admit ``req`` on its cached prefix (``node``, already locked) and give it a table row."""
        req.last_node = node
        req.prefix_len = prefix_len
        req.kv_slots = prefix_slots[:prefix_len].clone()
        req.req_pool_idx = self.req_to_token_pool.alloc()

    def return_row(self, req: Req) -> None:
        """Undo :meth:`take_row` for a request whose batch never ran: unlock its prefix, free its row."""
        self.tree_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.prefix_len, req.kv_slots = None, None, 0, EMPTY_SLOTS
        self.release_adapter(req)

    def share_prompt(self, req: Req) -> None:
        """Put a just-prefilled prompt in the prefix cache so requests admitted later reuse it.

        Called after the prefill is queued: the device computes the KV before any later step reads it.
        """
        before = req.kv_slots
        self.tree_cache.cache_unfinished_req(req)
        if req.kv_slots is before or torch.equal(req.kv_slots, before):
            return
        # Some pages were already cached by another request: point the table at the cached copies.
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        row[: req.kv_len] = to_device(req.kv_slots.to(row.dtype), row.device)

    def release(self, req: Req) -> None:
        """Hand a request's KV to the prefix cache (or free it) and its table row back."""
        known = req.seq_len
        if req.kv_len > known:
            # KV of tokens the host has not read (a step in flight, a verify step's positions past a stop):
            # nothing to cache it under.
            self.shorten([(req, known)])
        self.tree_cache.cache_finished_req(req)
        if req.req_pool_idx is not None:
            self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_slots = EMPTY_SLOTS
        req.prefix_len = 0
        req.last_node = None
        self.release_adapter(req)

    def take_adapter(self, req: Req) -> bool:
        """Give an admitted request its adapter's device slot; False when none is free (it waits)."""
        if self.lora is None:
            return True
        slot = self.lora.acquire(req.lora_name)
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def release_adapter(self, req: Req) -> None:
        """Give back the request's hold on its adapter's slot (nothing when it holds none)."""
        if self.lora is not None and req.lora_slot != NO_ADAPTER:
            self.lora.release(req.lora_slot)
        req.lora_slot = NO_ADAPTER

    # ------------------------------------------------------------------ the whole pool

    def clear(self) -> None:
        """Drop every cached prefix and free every slot and row (nothing may hold memory)."""
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()

    def stats(self) -> dict[str, int]:
        total = self.allocator.total_slots
        free = self.allocator.free_slots
        cached = self.tree_cache.evictable_size() + self.tree_cache.protected_size()
        return {"total_slots": total, "free_slots": free, "cached_slots": cached,
                "used_slots": total - free - cached, "page_size": self.page_size}
