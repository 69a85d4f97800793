"""Building the scheduler's next batch: admission into prefill, decode, retraction, and the KV memory
behind them.

Everything here works from what the host knows when the batch is built. Under overlap scheduling a
running request may have one token still in flight (``Req.pending_tokens``): its remaining budget and
its next KV position count that token, and its decode input is read from the device.
"""

from __future__ import annotations

import logging

import torch

from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.execution.overlap import to_device
from treadle.core.memory.radix_cache import NoPrefixCache
from treadle.core.request import FinishReason, Req
from treadle.core.scheduling.schedule_batch import BatchEntry, ScheduleBatch

logger = logging.getLogger("treadle.core.scheduling.scheduler")

EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)
# A waiting request whose next this-many uncached tokens equal those of a request
# admitted in the same batch waits one step and then reuses them from the cache.
IN_BATCH_PREFIX_TOKENS = 32


class BatchBuilding:
    """The Scheduler's batch-building half (a mixin: it reads and updates the Scheduler's state)."""

    # ------------------------------------------------------------------ prefill

    def _prefill_batch(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        cfg = self.config.scheduler
        latency_chunk = self._latency_chunk()
        budget = self.oom_backoff.prefill_budget(latency_chunk or self._chunk_tokens())
        entries: list[BatchEntry] = []
        may_chunk = latency_chunk > 0 or cfg.chunked_prefill_size is not None
        continuing = self.chunked_req
        if continuing is not None:
            extend = min(continuing.seq_len - continuing.kv_len, budget)
            entries.append(BatchEntry(continuing, continuing.kv_len, extend, EMPTY_SLOTS,
                                      write_from=continuing.kv_len))
            budget -= extend
            if budget > 0 and self.waiting:
                # A prompt's last chunk fills up with new prompts: alone it would cost a whole step (on a GPU
                # about one read of the weights) for a few hundred tokens. A new prompt cut here becomes the
                # chunked request; the finishing one goes to the running batch at commit.
                self._admit(entries, budget, may_chunk)
        elif self.waiting and not self._hold_prefill():
            self._admit(entries, budget, may_chunk)
        if not entries:
            return None
        self.prefill_held_steps = 0

        need = sum(self.allocator.slots_needed(e.kv_start, e.extend_len) for e in entries)
        slots = self._alloc(
            lambda: self.allocator.alloc_extend(
                [e.kv_start for e in entries], [e.extend_len for e in entries],
                self._last_slots([e.req for e in entries])),
            need,
        )
        if slots is None:  # admission checked memory, so this is rare: undo and wait for memory
            self._undo_admission(entries)
            return None
        self._assign_slots(entries, slots)
        for entry in entries:
            req = entry.req
            end = entry.kv_start + entry.extend_len
            entry.completes_sequence = end == req.seq_len
            if self._wants_input_logprobs(req):
                # A chunk before the first wanted position still computes its last row: the sampler
                # takes one row per request.
                low = min(max(entry.kv_start, req.logprob_start_len - 1, 0), end - 1)
                entry.logit_positions = range(low, end)
            else:
                entry.logit_positions = range(end - 1, end)
        mode = ForwardMode.EXTEND
        if (cfg.enable_mixed_chunk or latency_chunk) and self.running:
            decode = self._decode_entries(allow_retract=False)
            if decode:
                entries.extend(decode)
                mode = ForwardMode.MIXED
        return ScheduleBatch(mode, entries)

    def _chunk_tokens(self) -> int:
        """Prompt tokens in one full prefill step: the chunk size, or ``max_prefill_tokens`` without chunking."""
        cfg = self.config.scheduler
        return cfg.chunked_prefill_size or cfg.max_prefill_tokens

    def _latency_chunk(self) -> int:
        """The prompt tokens a step may carry while a trickle of requests arrives (0: not now).

        ``scheduler.latency_chunk_size`` applies while fewer requests decode than its value and the prompts
        waiting (with what is left of a chunked one) fit in one chunk: then each prefill piece rides in the
        decode step (a mixed batch) and a stream's next token waits about one decode step, not a whole
        prefill. A backlog (a burst, an offline batch) prefills in full chunks, as fast as it can.
        """
        cfg = self.config.scheduler
        size = int(cfg.latency_chunk_size)
        if size <= 0 or not self.running or len(self.running) >= size:
            return 0
        backlog = sum(req.seq_len - req.kv_len for req in self.waiting[:size])
        if self.chunked_req is not None:
            backlog += self.chunked_req.seq_len - self.chunked_req.kv_len
        return size if backlog <= self._chunk_tokens() else 0

    def _admit(self, entries: list[BatchEntry], budget: int, may_chunk: bool) -> None:
        cfg = self.config.scheduler
        reserve = self._decode_reserve()
        admitted_need = 0
        for req in self.policy.order(self.waiting, self.tree_cache):
            if len(self.running) + len(entries) >= self.oom_backoff.running_limit(cfg.max_running_requests) \
                    or budget <= 0:
                break
            if self.req_to_token_pool.free_count == 0:  # rows are taken as requests are admitted below
                break
            if req.pending_tokens:
                continue  # retracted with a token in flight: admitted once that token is known
            prefix_slots, node = self.tree_cache.match_prefix(req.all_ids)
            prefix_len = self._usable_prefix(req, len(prefix_slots))
            if self._shares_uncached_prefix(req, prefix_len, entries):
                continue  # computed once by the request already admitted, then reused from the cache
            remaining = req.seq_len - prefix_len
            extend = min(remaining, budget)
            if not may_chunk and extend < remaining:
                if entries:
                    break
                extend = remaining  # a prompt longer than max_prefill_tokens still runs, alone
            need = self.allocator.slots_needed(prefix_len, extend)
            future = int(self._remaining_new_tokens(req) * self.new_token_ratio) if extend == remaining else 0
            # Lock first: the matched prefix stops counting as evictable memory.
            self.tree_cache.inc_lock_ref(node)
            available = self.allocator.free_slots + self.tree_cache.evictable_size() - reserve - admitted_need
            alone = not entries and not self.running
            if need > available or (need + future > available and not alone):
                self.tree_cache.dec_lock_ref(node)
                break
            req.last_node = node
            req.prefix_len = prefix_len
            req.kv_slots = prefix_slots[:prefix_len].clone()
            if req.retractions == 0 and not req.output_ids:
                req.cached_tokens = prefix_len
                self.cached_tokens_total += prefix_len
            req.req_pool_idx = self.req_to_token_pool.alloc()
            entries.append(BatchEntry(req, prefix_len, extend, EMPTY_SLOTS, write_from=0))
            admitted_need += need + future
            budget -= extend
            if extend < remaining:
                self.chunked_req = req
                break
        admitted = {id(e.req) for e in entries}
        self.waiting = [req for req in self.waiting if id(req) not in admitted]

    def _hold_prefill(self) -> bool:
        """Whether a new prefill waits for more requests to join it (``scheduler.prefill_hold_steps``).

        Every forward reads all the weights, so on a GPU a prefill of a few hundred tokens costs about as much
        as one of a few thousand, and it stalls the whole decode batch. While half the running limit or more is
        decoding, a prefill whose waiting prompts (as many as there is room for) hold less than one chunk waits
        a few decode steps, during which more running requests finish and make room. When every waiting request
        fits the room already, more room lets no more in, so nothing waits: the last requests of an offline batch
        start at once rather than a hold apart.
        """
        cfg = self.config.scheduler
        limit = int(cfg.max_running_requests)
        room = limit - len(self.running)
        if (self.prefill_held_steps >= cfg.prefill_hold_steps or room <= 0 or len(self.running) < limit // 2
                or len(self.waiting) <= room):
            return False
        prompt_tokens = sum(req.seq_len for req in self.waiting[:room])
        if prompt_tokens >= self._chunk_tokens():
            return False
        self.prefill_held_steps += 1
        return True

    def _shares_uncached_prefix(self, req: Req, prefix_len: int, entries: list[BatchEntry]) -> bool:
        """Whether ``req``'s next uncached tokens are being computed by another request in this batch."""
        if isinstance(self.tree_cache, NoPrefixCache):
            return False
        window = req.all_ids[prefix_len:prefix_len + IN_BATCH_PREFIX_TOKENS]
        if len(window) < IN_BATCH_PREFIX_TOKENS:
            return False
        return any(
            entry.req.all_ids[prefix_len:prefix_len + IN_BATCH_PREFIX_TOKENS] == window
            and entry.kv_start <= prefix_len
            for entry in entries
        )

    def _undo_admission(self, entries: list[BatchEntry]) -> None:
        """Put the prompts admitted into a batch back in the queue. A continuing chunk (the only entry written
        from a position past 0) keeps what it has and stays the chunked request."""
        continuing = None
        for entry in reversed(entries):  # reinserted at the front in their admission order
            req = entry.req
            if entry.write_from > 0:
                continuing = req
                continue
            self.tree_cache.dec_lock_ref(req.last_node)
            self.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx, req.last_node, req.prefix_len, req.kv_slots = None, None, 0, EMPTY_SLOTS
            if req is self.chunked_req:
                self.chunked_req = None
            self.waiting.insert(0, req)
        if continuing is not None:
            self.chunked_req = continuing

    # ------------------------------------------------------------------- decode

    def _decode_batch(self) -> ScheduleBatch | None:
        entries = self._decode_entries(allow_retract=True)
        return ScheduleBatch(ForwardMode.DECODE, entries) if entries else None

    def _decode_entries(self, allow_retract: bool) -> list[BatchEntry]:
        while True:
            # A request whose in-flight token is surely its last (length limits) is not stepped again.
            reqs = [req for req in self.running if not self._ends_with_pending_token(req)]
            if not reqs:
                return []
            # Page size 1: one slot each (the common case, skipping a call per request).
            need = len(reqs) if self.page_size == 1 else sum(self.allocator.slots_needed(r.kv_len, 1) for r in reqs)
            if need <= self.allocator.free_slots + self.tree_cache.evictable_size():
                break
            if not allow_retract:
                return []
            if self._inflight is not None:
                # Read the step in flight first: requests it finishes free their memory, and the
                # ones left have no unknown token, so retraction acts on exact state.
                self._settle()
                continue
            if self.chunked_req is not None:
                # A prompt part-way through its chunks holds KV but decodes nothing yet: it goes back first
                # (what it computed stays in the prefix cache, evictable, and is reused when it is admitted again).
                self._retract(self.chunked_req)
                continue
            if len(reqs) == 1:
                # Nothing left to retract: the pool cannot hold this one sequence any longer.
                req = reqs[0]
                req.finish(FinishReason.LENGTH, "the KV cache is full")
                self.running.remove(req)
                self._finish(req)
                self._pending.append(self._output(req, []))
                return []
            self._retract(max(reqs, key=lambda r: r.arrival))
        kv_lens = [req.kv_len for req in reqs]
        slots = self._alloc(lambda: self.allocator.alloc_decode(kv_lens, self._last_slots(reqs)), need)
        assert slots is not None, "decode allocation failed after eviction"
        entries = [BatchEntry(req, kv_len, 1, EMPTY_SLOTS, write_from=kv_len, input_on_device=True)
                   for req, kv_len in zip(reqs, kv_lens)]
        self._assign_slots(entries, slots)
        for entry in entries:
            entry.logit_positions = range(entry.kv_start, entry.kv_start + 1)
        self.new_token_ratio = max(self.config.scheduler.new_token_ratio, self.new_token_ratio - 0.002)
        return entries

    def _ends_with_pending_token(self, req: Req) -> bool:
        if not req.pending_tokens:
            return False
        return self._remaining_new_tokens(req) <= 0 or req.seq_len + req.pending_tokens >= self.context_len

    # --------------------------------------------------------- batch admitted

    def _commit(self, batch: ScheduleBatch) -> None:
        """The batch is on the device: count its in-flight tokens; completed prompts start decoding."""
        for entry in batch.entries:
            if not entry.completes_sequence:
                continue
            req = entry.req
            req.pending_tokens += 1
            if entry.input_on_device:
                continue  # a decode row: already running
            if req is self.chunked_req:
                self.chunked_req = None
            self._share_prompt(req)
            self.running.append(req)

    # ------------------------------------------------------------------ memory

    def _share_prompt(self, req: Req) -> None:
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

    def _alloc(self, allocate, need: int) -> torch.Tensor | None:
        shortfall = need - self.allocator.free_slots
        if shortfall > 0:
            self.tree_cache.evict(shortfall)
        return allocate()

    def _assign_slots(self, entries: list[BatchEntry], slots: torch.Tensor) -> None:
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

    def _last_slots(self, reqs: list[Req]) -> list[int]:
        """Each request's last KV slot, for the allocator to continue a partly filled page; with page
        size 1 no page is ever partly filled, so -1 (the contract of ``alloc_extend``) without reading them."""
        if self.page_size == 1:
            return [-1] * len(reqs)
        return [req.last_kv_slot for req in reqs]

    def _release(self, req: Req) -> None:
        """Hand a request's KV to the prefix cache (or free it) and its table row back."""
        known = req.seq_len
        if req.kv_len > known:
            # KV of a token the host has not read yet (a step in flight): nothing to cache it under.
            self.allocator.free(req.kv_slots[known:])
            req.kv_slots = req.kv_slots[:known]
        self.tree_cache.cache_finished_req(req)
        if req.req_pool_idx is not None:
            self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_slots = EMPTY_SLOTS
        req.prefix_len = 0
        req.last_node = None

    def _finish(self, req: Req) -> None:
        self._release(req)
        self.grammar.release(req)
        self.num_finished += 1
        self._forget(req)

    def _forget(self, req: Req) -> None:
        """Take a finished request out of ``live_by_rid`` (its id may be used again)."""
        if self.live_by_rid.get(req.rid) is req:
            del self.live_by_rid[req.rid]

    def _retract(self, req: Req) -> None:
        """Free a running request's KV (or the chunked prompt's) and put it back at the front of the queue."""
        if req is self.chunked_req:
            self.chunked_req = None
        else:
            self.running.remove(req)
        self._release(req)
        if not req.input_logprobs_sent:  # its prompt's log-probs are computed again when it is admitted again
            req.input_token_logprobs.clear()
            req.input_top_logprobs.clear()
        req.retractions += 1
        self.num_retractions += 1
        self.waiting.insert(0, req)
        # Admit more cautiously for a while, so the same requests are not retracted again at once.
        self.new_token_ratio = 1.0
        logger.info("retracted request %s (%d tokens) to free KV memory", req.rid, req.seq_len)

    def _decode_reserve(self) -> int:
        return int(sum(self._remaining_new_tokens(req) for req in self.running) * self.new_token_ratio)

    def _remaining_new_tokens(self, req: Req) -> int:
        return max(0, req.sampling_params.max_new_tokens - len(req.output_ids) - req.pending_tokens)

    def _usable_prefix(self, req: Req, matched: int) -> int:
        limit = req.seq_len - 1  # at least one token is computed, to produce logits
        if self._wants_input_logprobs(req):
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        usable = min(matched, limit)
        return usable - usable % self.page_size

    def _wants_input_logprobs(self, req: Req) -> bool:
        return (req.return_logprob and req.logprob_start_len >= 0 and not req.input_logprobs_sent
                and not req.output_ids and req.logprob_start_len < len(req.origin_input_ids))
