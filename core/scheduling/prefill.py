"""Prefill batches: admitting waiting requests in the policy's order, reusing cached prefixes, cutting long
prompts into chunks, holding small prefills back under load, and latency chunks beside a small decode batch.

Everything here works from what the host knows when the batch is built (docs/scheduling.md).
"""

from __future__ import annotations

from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.request import Req
from treadle.core.resolved_config import ResolvedConfig
from treadle.core.scheduling.decode import DecodeManager
from treadle.core.scheduling.kv_memory import EMPTY_SLOTS, KVMemory
from treadle.core.scheduling.oom import OomBackoff
from treadle.core.scheduling.policy import SchedulePolicy
from treadle.core.scheduling.schedule_batch import BatchEntry, ScheduleBatch
from treadle.core.scheduling.state import SchedulerState, remaining_new_tokens, wants_input_logprobs

# A waiting request whose next this-many uncached tokens equal those of a request
# admitted in the same batch waits one step and then reuses them from the cache.
IN_BATCH_PREFIX_TOKENS = 32


class PrefillManager:
    """Builds prefill (extend) batches, with the running decodes mixed in when configured, and undoes an admission."""

    def __init__(self, config: ResolvedConfig, state: SchedulerState, memory: KVMemory, decode: DecodeManager,
                 policy: SchedulePolicy, oom_backoff: OomBackoff) -> None:
        self.config = config
        self.state = state
        self.memory = memory
        self.decode = decode
        self.policy = policy
        self.oom_backoff = oom_backoff
        self.held_steps = 0  # decode steps the waiting requests were held back (see hold_prefill)

    def build_batch(self) -> ScheduleBatch | None:
        """This step's prefill batch, or None (nothing waiting, held back, or no memory for it)."""
        state = self.state
        if not state.waiting and state.chunked_req is None:
            return None
        latency_chunk = self.latency_chunk()
        budget = self.oom_backoff.prefill_budget(latency_chunk or self.chunk_tokens())
        may_chunk = latency_chunk > 0 or self.config.scheduler.chunked_prefill_size is not None
        entries: list[BatchEntry] = []
        continuing = state.chunked_req
        if continuing is not None:
            extend = min(continuing.seq_len - continuing.kv_len, budget)
            entries.append(BatchEntry(continuing, continuing.kv_len, extend, EMPTY_SLOTS,
                                      write_from=continuing.kv_len))
            budget -= extend
            if budget > 0 and state.waiting:
                # A prompt's last chunk fills up with new prompts: alone it would cost a whole step (on a GPU
                # about one read of the weights) for a few hundred tokens. A new prompt cut here becomes the
                # chunked request; the finishing one goes to the running batch at commit.
                self._admit(entries, budget, may_chunk)
        elif state.waiting and not self.hold_prefill():
            self._admit(entries, budget, may_chunk)
        if not entries:
            return None
        self.held_steps = 0
        slots = self.memory.alloc_extend(entries)
        if slots is None:  # admission checked memory, so this is rare: undo and wait for memory
            self.undo_admission(entries)
            return None
        self.memory.assign_slots(entries, slots)
        _set_logit_positions(entries)
        if state.observers:
            state.observers.requests_admitted([e.req for e in entries if e.req is not continuing])
        mode = ForwardMode.EXTEND
        if (self.config.scheduler.enable_mixed_chunk or latency_chunk) and state.running:
            decode = self.decode.entries(allow_retract=False)
            if decode:
                entries.extend(decode)
                mode = ForwardMode.MIXED
        return ScheduleBatch(mode, entries)

    def chunk_tokens(self) -> int:
        """Prompt tokens in one full prefill step: the chunk size, or ``max_prefill_tokens`` without chunking."""
        cfg = self.config.scheduler
        return cfg.chunked_prefill_size or cfg.max_prefill_tokens

    def latency_chunk(self) -> int:
        """The prompt tokens a step may carry while a trickle of requests arrives (0: not now).

        ``scheduler.latency_chunk_size`` applies while fewer requests decode than its value and the prompts
        waiting (with what is left of a chunked one) fit in one chunk: then each prefill piece rides in the
        decode step (a mixed batch) and a stream's next token waits about one decode step, not a whole
        prefill. A backlog (a burst, an offline batch) prefills in full chunks, as fast as it can.
        """
        size = self.config.scheduler.latency_chunk_size
        state = self.state
        if size <= 0 or not state.running or len(state.running) >= size:
            return 0
        backlog = sum(req.seq_len - req.kv_len for req in state.waiting[:size])
        if state.chunked_req is not None:
            backlog += state.chunked_req.seq_len - state.chunked_req.kv_len
        return size if backlog <= self.chunk_tokens() else 0

    def hold_prefill(self) -> bool:
        """Whether a new prefill waits for more requests to join it (``scheduler.prefill_hold_steps``).

        Every forward reads all the weights, so on a GPU a prefill of a few hundred tokens costs about as much
        as one of a few thousand, and it stalls the whole decode batch. While half the running limit or more is
        decoding, a prefill whose waiting prompts (as many as there is room for) hold less than one chunk waits
        a few decode steps, during which more running requests finish and make room. When every waiting request
        fits the room already, more room lets no more in, so nothing waits: the last requests of an offline batch
        start at once rather than a hold apart.
        """
        cfg = self.config.scheduler
        state = self.state
        limit = cfg.max_running_requests
        room = limit - len(state.running)
        if (self.held_steps >= cfg.prefill_hold_steps or room <= 0 or len(state.running) < limit // 2
                or len(state.waiting) <= room):
            return False
        prompt_tokens = sum(req.seq_len for req in state.waiting[:room])
        if prompt_tokens >= self.chunk_tokens():
            return False
        self.held_steps += 1
        return True

    def undo_admission(self, entries: list[BatchEntry]) -> None:
        """Put the prompts admitted into a batch back in the queue. A continuing chunk (the only entry written
        from a position past 0) keeps what it has and stays the chunked request."""
        state = self.state
        continuing = None
        for entry in reversed(entries):  # reinserted at the front in their admission order
            req = entry.req
            if entry.write_from > 0:
                continuing = req
                continue
            self.memory.return_row(req)
            if req is state.chunked_req:
                state.chunked_req = None
            state.waiting.insert(0, req)
        if continuing is not None:
            state.chunked_req = continuing

    # ------------------------------------------------------------------ admission

    def _admit(self, entries: list[BatchEntry], budget: int, may_chunk: bool) -> None:
        state = self.state
        tree_cache = self.memory.tree_cache
        running_limit = self.oom_backoff.running_limit(self.config.scheduler.max_running_requests)
        reserve = self.decode.reserve()
        admitted_need = 0
        for req in self.policy.order(state.waiting, tree_cache):
            if len(state.running) + len(entries) >= running_limit or budget <= 0:
                break
            if self.memory.req_to_token_pool.free_count == 0:  # rows are taken as requests are admitted below
                break
            if req.pending_tokens:
                continue  # retracted with a token in flight: admitted once that token is known
            prefix_slots, node = tree_cache.match_prefix(req.all_ids, req.lora_uid)
            prefix_len = self._usable_prefix(req, len(prefix_slots))
            if self._shares_uncached_prefix(req, prefix_len, entries):
                continue  # computed once by the request already admitted, then reused from the cache
            remaining = req.seq_len - prefix_len
            extend = min(remaining, budget)
            if not may_chunk and extend < remaining:
                if entries:
                    break
                extend = remaining  # a prompt longer than max_prefill_tokens still runs, alone
            need = self.memory.allocator.slots_needed(prefix_len, extend)
            future = int(remaining_new_tokens(req) * state.new_token_ratio) if extend == remaining else 0
            # Lock first: the matched prefix stops counting as evictable memory.
            tree_cache.inc_lock_ref(node)
            available = self.memory.available() - reserve - admitted_need
            alone = not entries and not state.running
            if need > available or (need + future > available and not alone):
                tree_cache.dec_lock_ref(node)
                break
            if not self.memory.take_adapter(req):
                tree_cache.dec_lock_ref(node)
                continue  # every adapter slot is held by other adapters' requests: it waits for one
            self.memory.take_row(req, prefix_slots, prefix_len, node)
            if req.retractions == 0 and not req.output_ids:
                req.cached_tokens = prefix_len
                state.cached_tokens_total += prefix_len
            entries.append(BatchEntry(req, prefix_len, extend, EMPTY_SLOTS, write_from=0))
            admitted_need += need + future
            budget -= extend
            if extend < remaining:
                state.chunked_req = req
                break
        admitted = {id(e.req) for e in entries}
        state.waiting = [req for req in state.waiting if id(req) not in admitted]

    def _shares_uncached_prefix(self, req: Req, prefix_len: int, entries: list[BatchEntry]) -> bool:
        """Whether ``req``'s next uncached tokens are being computed by another request in this batch."""
        if not self.memory.caches_prefixes:
            return False
        window = req.all_ids[prefix_len:prefix_len + IN_BATCH_PREFIX_TOKENS]
        if len(window) < IN_BATCH_PREFIX_TOKENS:
            return False
        return any(
            entry.req.all_ids[prefix_len:prefix_len + IN_BATCH_PREFIX_TOKENS] == window
            and entry.kv_start <= prefix_len and entry.req.lora_uid == req.lora_uid
            for entry in entries
        )

    def _usable_prefix(self, req: Req, matched: int) -> int:
        limit = req.seq_len - 1  # at least one token is computed, to produce logits
        if wants_input_logprobs(req):
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        if req.wants_embedding:
            limit = min(limit, req.hidden_states_from)  # the pooling reads these positions' hidden states
        usable = min(matched, limit)
        return usable - usable % self.memory.page_size


def _set_logit_positions(entries: list[BatchEntry]) -> None:
    """Which positions of each admitted prompt need logits: the last one, or every one whose log-prob was asked."""
    for entry in entries:
        req = entry.req
        end = entry.kv_start + entry.extend_len
        entry.completes_sequence = end == req.seq_len
        if wants_input_logprobs(req):
            # A chunk before the first wanted position still computes its last row: the sampler
            # takes one row per request.
            low = min(max(entry.kv_start, req.logprob_start_len - 1, 0), end - 1)
            entry.logit_positions = range(low, end)
        else:
            entry.logit_positions = range(end - 1, end)
