"""Surviving a device out-of-memory during a forward: retract the batch, retry smaller.

When ``ModelRunner.forward`` raises ``torch.cuda.OutOfMemoryError`` the batch
never ran. :func:`retract_after_oom` undoes it — the KV slots it allocated go
back to the pool (a verify step's ``t`` per request too), new admissions return
to the front of the queue, and running requests beyond the new cap are
retracted (their computed prefix stays in the radix cache) — and
:class:`OomBackoff` halves the caps on running requests (decode, verify OOM)
and prefill tokens (prefill OOM) that the scheduler admits against. After ``relax_after`` steps without an OOM the caps double again. A
batch that cannot shrink any further (one request, one small chunk) fails that
request with ``finish_reason: "abort"`` instead of crashing the server.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.request import FinishReason

if TYPE_CHECKING:
    from treadle.core.scheduling.schedule_batch import ScheduleBatch
    from treadle.core.scheduling.scheduler import Scheduler

logger = logging.getLogger("treadle.core.scheduling.scheduler")

# The smallest prefill chunk tried before giving up on a request.
MIN_PREFILL_TOKENS = 16
# Batches of running requests: an OOM in one lowers the cap on running requests.
_STEPS_RUNNING_REQUESTS = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.MIXED)


class OomBackoff:
    """Caps on running requests and prefill tokens after a device OOM (None: no cap), relaxed over time."""

    def __init__(self, relax_after: int = 64) -> None:
        self.relax_after = relax_after
        self.max_running: int | None = None
        self.max_prefill_tokens: int | None = None
        self.count = 0  # OOMs survived so far (the /metrics counter)
        self._quiet_steps = 0

    def running_limit(self, configured: int) -> int:
        return configured if self.max_running is None else min(configured, self.max_running)

    def prefill_budget(self, configured: int) -> int:
        return configured if self.max_prefill_tokens is None else min(configured, self.max_prefill_tokens)

    def on_oom(self, mode: ForwardMode, num_reqs: int, extend_tokens: int) -> bool:
        """Lower a cap the failed batch ran into; False when nothing smaller is left to try.

        Every OOM strictly lowers a cap (or gives up), so retrying always ends.
        """
        self.count += 1
        self._quiet_steps = 0
        shrinks = False
        if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            shrinks = self._shrink_prefill(extend_tokens)
        if (mode in _STEPS_RUNNING_REQUESTS or not shrinks) and num_reqs > 1:
            shrinks = self._shrink_running(num_reqs) or shrinks
        return shrinks

    def _shrink_prefill(self, extend_tokens: int) -> bool:
        # From the smaller of the cap and the batch: a prompt that ran whole (chunking off) lowers the cap too.
        current = min(extend_tokens, self.max_prefill_tokens or extend_tokens)
        smaller = max(MIN_PREFILL_TOKENS, current // 2)
        if smaller >= current:
            return False
        self.max_prefill_tokens = smaller
        return True

    def _shrink_running(self, num_reqs: int) -> bool:
        current = min(num_reqs, self.max_running or num_reqs)
        smaller = max(1, current // 2)
        if smaller >= current:
            return False
        self.max_running = smaller
        return True

    def on_success(self) -> None:
        if self.max_running is None and self.max_prefill_tokens is None:
            return
        self._quiet_steps += 1
        if self._quiet_steps >= self.relax_after:
            self._quiet_steps = 0
            self.max_running = None if self.max_running is None else self.max_running * 2
            self.max_prefill_tokens = None if self.max_prefill_tokens is None else self.max_prefill_tokens * 2


def retract_after_oom(scheduler: "Scheduler", batch: "ScheduleBatch", error: BaseException) -> None:
    """Undo ``batch`` (its forward ran out of device memory) and lower the scheduler's caps."""
    entries = batch.entries
    extend_tokens = sum(e.extend_len for e in entries if not e.input_on_device)
    backoff = scheduler.oom_backoff
    shrinks = backoff.on_oom(batch.forward_mode, len(entries), extend_tokens)
    logger.warning("device out of memory in a %s batch of %d requests (%d prefill tokens); retrying smaller "
                   "(running cap %s, prefill cap %s): %s", batch.forward_mode.name, len(entries), extend_tokens,
                   backoff.max_running, backoff.max_prefill_tokens, error)
    for entry in entries:
        scheduler.memory.drop_new_slots(entry)
    if not shrinks:
        # Nothing smaller to try: end this request (its KV freed) so the others can go on.
        req = entries[0].req
        logger.error("request %s does not fit in device memory even alone; aborting it", req.rid)
        scheduler.lifecycle.end(req, FinishReason.ABORT, f"out of device memory: {error}")
    else:
        admitted = [e for e in entries if e.req not in scheduler.running]
        for entry in admitted:
            entry.req.retractions += 1  # its cached prefix is not counted twice when it is admitted again
        scheduler.prefill_manager.undo_admission(admitted)
        scheduler.settle()  # read the step in flight, so retraction acts on exact state
        limit = backoff.running_limit(len(scheduler.running))
        while len(scheduler.running) > limit:
            scheduler.lifecycle.retract(max(scheduler.running, key=lambda r: r.arrival))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
