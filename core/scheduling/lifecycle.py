"""Moving requests between the scheduler's queues and ending them.

A request waits (``waiting``), is admitted into a batch (its prompt perhaps in chunks: ``chunked_req``), runs
(``running``) once its prompt is on the device, and ends: finished (a stop, a length limit), aborted, or ended
early when it cannot fit. Under memory pressure a running request (or the chunked prompt) is retracted: its KV
goes to the prefix cache and it waits again, at the front.
"""

from __future__ import annotations

import logging

from treadle.core.request import FinishReason, Req, ReqOutput
from treadle.core.scheduling.kv_memory import KVMemory
from treadle.core.scheduling.output import req_output
from treadle.core.scheduling.schedule_batch import ScheduleBatch
from treadle.core.scheduling.state import SchedulerState

logger = logging.getLogger("treadle.core.scheduling.scheduler")


class RequestLifecycle:
    """Starts, retracts, finishes and aborts requests, keeping the queues, the KV memory and the counters in step."""

    def __init__(self, state: SchedulerState, memory: KVMemory, grammar) -> None:
        self.state = state
        self.memory = memory
        self.grammar = grammar

    def commit(self, batch: ScheduleBatch) -> None:
        """The batch is on the device: count its in-flight tokens; completed prompts enter the prefix cache and
        start decoding."""
        state = self.state
        for entry in batch.entries:
            if not entry.completes_sequence:
                continue
            req = entry.req
            req.pending_tokens += 1
            if entry.input_on_device:
                continue  # a decode row: already running
            if req is state.chunked_req:
                state.chunked_req = None
            self.memory.share_prompt(req)
            if not req.wants_embedding:  # an embedding request ends with this step: it never decodes
                state.running.append(req)

    def retract(self, req: Req) -> None:
        """Free a running request's KV (or the chunked prompt's) and put it back at the front of the queue."""
        state = self.state
        if req is state.chunked_req:
            state.chunked_req = None
        else:
            state.running.remove(req)
        self.memory.release(req)
        req.pooled = None  # its chunks are computed again
        if not req.input_logprobs_sent:  # its prompt's log-probs are computed again when it is admitted again
            req.input_token_logprobs.clear()
            req.input_top_logprobs.clear()
        req.retractions += 1
        state.num_retractions += 1
        state.waiting.insert(0, req)
        # Admit more cautiously for a while, so the same requests are not retracted again at once.
        state.new_token_ratio = 1.0
        logger.info("retracted request %s (%d tokens) to free KV memory", req.rid, req.seq_len)
        if state.observers:
            state.observers.request_retracted(req)

    def finish(self, req: Req) -> None:
        """A finished request (``req.finish`` was called) leaves the running batch; its memory and grammar state go back."""
        state = self.state
        if req in state.running:
            state.running.remove(req)
        self.memory.release(req)
        self.grammar.release(req)
        state.num_finished += 1
        state.forget(req)
        if state.observers:
            state.observers.request_finished(req)

    def end(self, req: Req, reason: str, detail: str) -> None:
        """End a request that cannot go on wherever it is (the KV pool cannot hold it, the device ran out of
        memory with it alone), and queue its last output."""
        self._take_out(req)
        req.finish(reason, detail)
        self.finish(req)
        self.state.outputs.append(req_output(req, []))

    def abort(self, req: Req) -> ReqOutput:
        """Stop a request wherever it is and free its memory; its last output."""
        self.grammar.release(req)
        if not self._take_out(req):
            # A step in flight may still write this request's KV; the device runs it before any
            # step that reuses the slots, so they can be freed now. Its token will be discarded.
            self.memory.release(req)
        req.finish(FinishReason.ABORT, "aborted")
        self.state.forget(req)
        if self.state.observers:
            self.state.observers.request_finished(req)
        return req_output(req, [])

    def _take_out(self, req: Req) -> bool:
        """Take ``req`` out of whichever queue holds it; True when it was waiting (holding no memory)."""
        state = self.state
        if req in state.waiting:
            state.waiting.remove(req)
            return True
        if req is state.chunked_req:
            state.chunked_req = None
        if req in state.running:
            state.running.remove(req)
        return False
