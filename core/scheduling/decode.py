"""Decode batches: the next token of every running request (or, with a speculative worker, its next few
positions to verify), and making room when the KV pool is short.

Under overlap scheduling a running request may have a step still in flight (``Req.pending_tokens``: the tokens
it will add, at least one): its remaining budget and its next KV position count them, and its decode input is
read from the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.request import FinishReason, Req
from treadle.core.resolved_config import ResolvedConfig
from treadle.core.scheduling.kv_memory import EMPTY_SLOTS, KVMemory
from treadle.core.scheduling.lifecycle import RequestLifecycle
from treadle.core.scheduling.schedule_batch import BatchEntry, ScheduleBatch
from treadle.core.scheduling.state import SchedulerState, remaining_new_tokens

if TYPE_CHECKING:
    from treadle.core.execution.overlap import LaunchedStep


class DecodeManager:
    """Builds decode batches (alone, or as the decode rows of a mixed batch) and the reserve admission keeps for them.

    ``settle`` reads the step in flight, if any, and says whether there was one (``Scheduler.settle``).
    ``tokens_per_req`` is the worker's ``decode_tokens_per_req``: above 1 a decode step verifies drafts, each
    request carrying up to that many tokens (a TARGET_VERIFY batch; :meth:`verify_tokens`).
    """

    def __init__(self, config: ResolvedConfig, state: SchedulerState, memory: KVMemory, lifecycle: RequestLifecycle,
                 context_len: int, settle: Callable[[], bool], tokens_per_req: int = 1,
                 tokens_for: Callable[[list[Req]], int] | None = None,
                 overlaps_verify: Callable[[int], bool] | None = None) -> None:
        self.config = config
        self.state = state
        self.memory = memory
        self.lifecycle = lifecycle
        self.context_len = context_len
        self.settle = settle
        self.tokens_per_req = tokens_per_req
        self.tokens_for = tokens_for  # the worker's decode_tokens_for: fewer when fewer drafts are worth it
        self.overlaps_verify = overlaps_verify  # the worker's overlaps_verify (None: verify steps never overlap)

    def build_batch(self) -> ScheduleBatch | None:
        if self.tokens_per_req > 1:
            return self._build_verify_batch()
        entries = self.entries(allow_retract=True)
        return ScheduleBatch(ForwardMode.DECODE, entries) if entries else None

    def entries(self, allow_retract: bool) -> list[BatchEntry]:
        """A decode row for every running request that steps again, with its KV slot; without ``allow_retract``
        none when the pool cannot hold them all."""
        while True:
            reqs = self._stepping_reqs()
            if not reqs:
                return []
            need = self.memory.decode_slots_needed(reqs)
            if need <= self.memory.available():
                break
            if not allow_retract or not self._make_room(reqs):
                return []
        kv_lens = [req.kv_len for req in reqs]
        slots = self.memory.alloc_decode(reqs, kv_lens, need)
        assert slots is not None, "decode allocation failed after eviction"
        entries = [BatchEntry(req, kv_len, 1, EMPTY_SLOTS, write_from=kv_len, input_on_device=True)
                   for req, kv_len in zip(reqs, kv_lens)]
        self.memory.assign_slots(entries, slots)
        for entry in entries:
            entry.logit_positions = range(entry.kv_start, entry.kv_start + 1)
        self._decay_new_token_ratio()
        return entries

    def _build_verify_batch(self) -> ScheduleBatch | None:
        """Every running request's next ``t`` positions (its last token, then ``t - 1`` drafts the worker
        supplies): a TARGET_VERIFY batch, or a DECODE one when ``t`` is 1 (:meth:`verify_tokens`)."""
        while True:
            reqs = self._stepping_reqs()
            if not reqs:
                return None
            per_req, need = self.verify_tokens(reqs)
            if per_req:
                break
            if not self._make_room(reqs):
                return None
        if per_req == 1:
            entries = self.entries(allow_retract=False)  # the same requests, and room for one slot each
            return ScheduleBatch(ForwardMode.DECODE, entries) if entries else None
        entries = self._verify_entries(reqs, per_req, need)
        assert entries is not None, "verify allocation failed after eviction"
        return ScheduleBatch(ForwardMode.TARGET_VERIFY, entries)

    def overlapped_verify_batch(self, step: "LaunchedStep") -> ScheduleBatch | None:
        """The next verify batch of ``step``'s requests, built before ``step`` (a verify step of draft chains in
        flight) is read: None where it cannot be (the caller then waits for ``step`` and builds as usual).

        Each request's next tokens follow its accepted drafts, known only on the device: the batch ``follows``
        ``step`` and the worker places them there (core/execution/forward_inputs.py). The host gives each request
        ``t`` more KV slots as if every draft of ``step`` were kept (``kv_start`` = its KV length so far, an upper
        bound) and, reading ``step``, moves them to their place and frees the rejected ones
        (``OutputProcessing.take_positions``). Budgets count one token of ``step`` per request (its least), so a
        request that finishes within ``step`` wastes its row here, whose tokens are then discarded; where every
        request would reach its budget if ``step`` kept all its drafts, there is no overlapped batch. Not for
        constrained, penalized, log-prob or multimodal requests, nor while requests wait or a prompt is chunked.
        """
        previous = step.batch
        if (self.overlaps_verify is None or previous.forward_mode is not ForwardMode.TARGET_VERIFY
                or step.accepted is None or step.tree is not None or step.draft_probs is not None
                or self.state.waiting or self.state.chunked_req is not None):
            return None
        row_of = {id(entry.req): i for i, entry in enumerate(previous.entries)}
        reqs = self._stepping_reqs()
        if not reqs or not all(id(req) in row_of and _overlappable(req) for req in reqs):
            return None
        if all(_may_end_within(req, previous.entries[row_of[id(req)]]) for req in reqs):
            # Each request reaches its token budget if ``step`` keeps all its drafts: a step queued now would be
            # thrown away whole then (a full forward, against the one host read that waiting costs).
            return None
        per_req, need = self.verify_tokens(reqs)
        if per_req < 2 or not self.overlaps_verify(len(reqs) * per_req):
            return None
        entries = self._verify_entries(reqs, per_req, need)
        if entries is None:
            return None
        return ScheduleBatch(ForwardMode.TARGET_VERIFY, entries, follows=step,
                             follow_rows=[row_of[id(req)] for req in reqs])

    def _verify_entries(self, reqs: list[Req], per_req: int, need: int) -> list[BatchEntry] | None:
        """A verify row of ``per_req`` positions for each of ``reqs`` from its KV length, with its slots (``need``
        of them in all); None when the pool cannot give them."""
        kv_lens = [req.kv_len for req in reqs]
        slots = self.memory.alloc_verify(reqs, kv_lens, per_req, need)
        if slots is None:
            return None
        entries = [BatchEntry(req, kv_len, per_req, EMPTY_SLOTS, write_from=kv_len,
                              logit_positions=range(kv_len, kv_len + per_req), input_on_device=True)
                   for req, kv_len in zip(reqs, kv_lens)]
        self.memory.assign_verify_slots(entries, slots, per_req)
        self._decay_new_token_ratio()
        return entries

    def verify_tokens(self, reqs: list[Req]) -> tuple[int, int]:
        """``(t, slots needed)`` of a decode step of ``reqs`` at ``t`` tokens per request; ``(0, 0)`` when the pool
        cannot hold even one each.

        ``t`` is the worker's ``k + 1``, lowered so that no request computes a position whose token would lie past
        the context length, to the most tokens any request may still take, and to what the pool holds (fewer
        drafts before any retraction); 1 (plain decode) while a request uses penalties, whose token counts at a
        draft's position would depend on the drafts before it, and while more requests run than
        ``speculative.max_batch_size`` (verifying them would cost more than it saves); for a constrained request, to
        ``1 +`` what its matcher can roll back (``GrammarMatcher.max_rollback_tokens``: each position's mask comes
        from walking the matcher through the drafts before it; 1 with draft trees); and to what the worker says is
        worth verifying (``tokens_for``: a speculator with nothing to propose makes it 1).
        """
        per_req = self.tokens_per_req if len(reqs) <= self.config.speculative.max_batch_size else 1
        most_wanted = 1
        for req in reqs:
            params = req.sampling_params
            if params.has_penalties:
                per_req = 1
                break
            if req.grammar is not None:  # its drafts are masked by walking its matcher, which then rolls back
                # A tree's nodes would each need the mask of their own path: constrained requests decode plainly.
                rollback = 0 if self.config.speculative.topk > 1 else getattr(req.grammar, "max_rollback_tokens", 0)
                per_req = min(per_req, 1 + max(0, rollback))
            per_req = min(per_req, self.context_len - 1 - req.kv_len)
            most_wanted = max(most_wanted, remaining_new_tokens(req))
        per_req = max(1, min(per_req, most_wanted))
        if per_req > 1 and self.tokens_for is not None:
            per_req = max(1, min(per_req, self.tokens_for(reqs)))
        available = self.memory.available()
        while per_req >= 1:
            need = self.memory.decode_slots_needed(reqs, per_req)
            if need <= available:
                return per_req, need
            per_req -= 1
        return 0, 0

    def _make_room(self, reqs: list[Req]) -> bool:
        """Free KV memory for the decode batch of ``reqs``; False when nothing is left to step."""
        if self.settle():
            # The step in flight was read first: requests it finished freed their memory, and the ones left
            # have no unknown token, so a retraction acts on exact state.
            return True
        if self.state.chunked_req is not None:
            # A prompt part-way through its chunks holds KV but decodes nothing yet: it goes back first
            # (what it computed stays in the prefix cache, evictable, and is reused when it is admitted again).
            self.lifecycle.retract(self.state.chunked_req)
            return True
        if len(reqs) == 1:
            # Nothing left to retract: the pool cannot hold this one sequence any longer.
            self.lifecycle.end(reqs[0], FinishReason.LENGTH, "the KV cache is full")
            return False
        self.lifecycle.retract(max(reqs, key=lambda r: r.arrival))
        return True

    def _stepping_reqs(self) -> list[Req]:
        """The running requests that step again: not those whose in-flight token is surely their last (length
        limits)."""
        return [req for req in self.state.running if not self.ends_with_pending_token(req)]

    def _decay_new_token_ratio(self) -> None:
        """A batch of running requests was built: admission may reserve a little less for them from now on."""
        self.state.new_token_ratio = max(self.config.scheduler.new_token_ratio, self.state.new_token_ratio - 0.002)

    def ends_with_pending_token(self, req: Req) -> bool:
        if not req.pending_tokens:
            return False
        return remaining_new_tokens(req) <= 0 or req.seq_len + req.pending_tokens >= self.context_len

    def reserve(self) -> int:
        """KV slots admission keeps free for the running requests' remaining tokens (``new_token_ratio`` of them)."""
        return int(sum(remaining_new_tokens(req) for req in self.state.running) * self.state.new_token_ratio)


def _may_end_within(req: Req, entry: BatchEntry) -> bool:
    """Whether ``req`` reaches its ``max_new_tokens`` if its verify ``entry`` (in flight, counted as one token in
    ``pending_tokens``) keeps every draft."""
    return entry.extend_len - 1 >= remaining_new_tokens(req)


def _overlappable(req: Req) -> bool:
    """Whether ``req`` may verify in an overlapped step: nothing of its sampling reads its host state per position."""
    return (req.grammar is None and not req.return_logprob and req.multimodal is None
            and not req.sampling_params.has_penalties)
