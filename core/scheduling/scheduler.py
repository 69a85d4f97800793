"""Scheduler: continuous batching over one ModelRunner, with overlap scheduling.

Each ``step()`` either admits waiting requests into an extend (prefill) batch —
in the order the schedule policy picks, reusing radix-cache prefixes, chunking
long prompts — or decodes one token for every running request. When decode
cannot get KV memory the newest requests are retracted to the queue; their
computed tokens stay in the prefix cache and are recomputed only if evicted.

Overlap (on unless ``scheduler.disable_overlap``): a step builds and queues
batch N+1 while the device still runs batch N, then reads N's sampled tokens
(they were copied to the host in the background), then queues N+1's sampling.
Decode inputs come from the device, so no token waits for the host before it
is fed back. Batch building lives in scheduler_batches.py, output handling in
scheduler_output.py; docs/scheduling.md describes the loop.
"""

from __future__ import annotations

import logging
from functools import cached_property
from typing import Any

import torch

from treadle.core.config import ServerConfig, validate_plugin_choices
from treadle.core.grammar import GrammarManager
from treadle.core.loading.hub import default_served_name
from treadle.core.execution.model_runner import ModelRunner
from treadle.core.scheduling.oom import OomBackoff, retract_after_oom
from treadle.core.execution.overlap import HostCopy, LaunchedStep, NextInputIds, to_device
from treadle.core.memory.radix_cache import NoPrefixCache, PrefixCache, RadixCache
from treadle.core.registry import Registry, build_registry
from treadle.core.request import FinishReason, InvalidRequestError, Req, ReqOutput, next_arrival
from treadle.core.execution.sampler import Sampler, SamplingBatch
from treadle.core import validation
from treadle.core.scheduling.schedule_batch import ScheduleBatch
from treadle.core.scheduling.batch_building import IN_BATCH_PREFIX_TOKENS, BatchBuilding
from treadle.core.scheduling.output import OutputProcessing
from treadle.text.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["IN_BATCH_PREFIX_TOKENS", "Scheduler"]


class Scheduler(BatchBuilding, OutputProcessing):
    """Admits, batches, runs and finishes requests; the same object backs Engine and the server."""

    def __init__(self, config: ServerConfig, registry: Registry | None = None, offline: bool = False) -> None:
        self.registry = registry if registry is not None else build_registry(config.plugins)
        validate_plugin_choices(config, self.registry)
        self.runner = ModelRunner(config, self.registry, offline=offline)
        self.config = self.runner.config  # every "auto" resolved; the caller's config stays as it was
        self.allocator = self.runner.allocator
        self.req_to_token_pool = self.runner.req_to_token_pool
        self.page_size = self.runner.page_size
        self.tree_cache: PrefixCache = (
            NoPrefixCache(self.allocator) if config.cache.disable_radix_cache
            else RadixCache(self.allocator, self.page_size)
        )
        self.policy = self.registry.get("schedule_policies", config.scheduler.policy)(config.scheduler.seed)
        self.sampler = Sampler()
        self.tokenizer = load_tokenizer(config.model.tokenizer_path or self.runner.model_dir)
        self.eos_token_ids = eos_token_ids(self.runner.hf_config, self.runner.model_dir, self.tokenizer)
        self.context_len = self.runner.context_len
        self.grammar = GrammarManager.from_config(config, self.registry, self.tokenizer, self.runner.vocab_size,
                                                  self.eos_token_ids, self.runner.device)

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.live_by_rid: dict[str, Req] = {}  # every queued or running request; finished ones leave it
        self._pending: list[ReqOutput] = []
        self.new_token_ratio = config.scheduler.new_token_ratio
        self.num_retractions = 0
        self.prefill_held_steps = 0  # decode steps the waiting requests were held back (see _hold_prefill)
        self.num_finished = 0
        self.cached_tokens_total = 0
        self.overlap = not config.scheduler.disable_overlap
        self.next_input_ids = NextInputIds(self.req_to_token_pool.size, self.runner.device)
        self._inflight: LaunchedStep | None = None  # queued on the device, its tokens not read yet
        self.oom_backoff = OomBackoff()

    # ----------------------------------------------------------------- public API

    @property
    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.runner.model_dir,
            "served_model_name": (self.config.model.served_model_name
                                  or default_served_name(self.config.model.path, self.runner.model_dir)),
            "architecture": self.runner.hf_config.architectures[0],
            "context_len": self.context_len,
            "vocab_size": self.runner.vocab_size,
            "eos_token_ids": sorted(self.eos_token_ids),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "device": str(self.runner.device),
            "has_tokenizer": self.tokenizer is not None,
        }

    @cached_property
    def request_limits(self) -> validation.RequestLimits:
        """What every request must fit (the HTTP process gets them through ``model_info``)."""
        return validation.RequestLimits(context_len=self.context_len, vocab_size=self.runner.vocab_size,
                                        kv_slots=self.allocator.total_slots,
                                        max_request_tokens=self.config.server.max_request_tokens)

    def add_request(self, req: Req) -> None:
        """Queue a request; raises InvalidRequestError when it can never run (:meth:`check_request`)."""
        self.check_request(req)
        room = self.context_len - len(req.origin_input_ids)
        if req.sampling_params.max_new_tokens > room:
            req.sampling_params.max_new_tokens = room
        self.grammar.attach(req)
        req.arrival = next_arrival()  # arrival order is queue order, whenever the Req was made
        self.waiting.append(req)
        self.live_by_rid[req.rid] = req

    def check_request(self, req: Req) -> None:
        """Raise InvalidRequestError when ``req`` could never run (:func:`core.validation.check_request`) or its id
        is taken; its constraint, if any, is compiled (and cached) to find out. Queues nothing."""
        validation.check_request(req.origin_input_ids, req.sampling_params, self.request_limits,
                                 top_logprobs_num=req.top_logprobs_num)
        live = self.live_by_rid.get(req.rid)
        if live is not None and not live.finished:
            raise InvalidRequestError(f"request id {req.rid!r} is already in use", param="rid")
        self.grammar.check(req)

    def abort_request(self, rid: str) -> ReqOutput | None:
        """Stop a request wherever it is and free its memory."""
        req = self.live_by_rid.get(rid)
        if req is None or req.finished:
            return None
        self.grammar.release(req)
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            if req is self.chunked_req:
                self.chunked_req = None
            if req in self.running:
                self.running.remove(req)
            # A step in flight may still write this request's KV; the device runs it before any
            # step that reuses the slots, so they can be freed now. Its token will be discarded.
            self._release(req)
        req.finish(FinishReason.ABORT, "aborted")
        self._forget(req)
        if self._inflight is not None and all(e.req.finished for e in self._inflight.batch.entries):
            self._inflight = None  # every token it computes would be discarded: nothing left to read
        return self._output(req, [])

    def step(self) -> list[ReqOutput]:
        """Run one batch; outputs for every request that produced tokens or finished.

        With overlap the outputs are those of the previous batch: this one is still on the device.
        """
        batch = self._prefill_batch()
        if batch is None and self.running:
            batch = self._decode_batch()
        launched = self._launch_forward(batch) if batch is not None else None
        self._settle()
        if launched is not None:
            self._launch_sampling(launched)
            self._inflight = launched
            if not self.overlap:
                self._settle()
        outputs, self._pending = self._pending, []
        return outputs

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req or self._pending or self._inflight)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests hold memory."""
        self._settle()
        if self.running or self.chunked_req:
            return False
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()
        return True

    def kv_stats(self) -> dict[str, int]:
        total = self.allocator.total_slots
        free = self.allocator.free_slots
        cached = self.tree_cache.evictable_size() + self.tree_cache.protected_size()
        return {
            "total_slots": total,
            "free_slots": free,
            "cached_slots": cached,
            "used_slots": total - free - cached,
            "page_size": self.page_size,
            "running": len(self.running) + (1 if self.chunked_req else 0),
            "live_requests": len(self.live_by_rid),
            "waiting": len(self.waiting),
            "retractions": self.num_retractions,
            "finished": self.num_finished,
            "cached_tokens_total": self.cached_tokens_total,
            "oom_retries": self.oom_backoff.count,
        }

    # ------------------------------------------------------------------ running

    def _launch_forward(self, batch: ScheduleBatch) -> LaunchedStep | None:
        """Queue the batch's forward on the device; the host goes on without waiting for it.

        None when the device ran out of memory: the batch was undone, to be retried smaller.
        """
        batch.write_req_to_token(self.req_to_token_pool.req_to_token)
        forward_batch = batch.to_forward_batch(self.runner, self.next_input_ids)
        try:
            logits = self.runner.forward(forward_batch)
        except torch.cuda.OutOfMemoryError as exc:
            retract_after_oom(self, batch, exc)
            return None
        self.oom_backoff.on_success()
        # After the forward is queued: sharing a prompt may re-point its table row at cached copies.
        self._commit(batch)
        return LaunchedStep(batch, forward_batch, logits)

    def _launch_sampling(self, step: LaunchedStep) -> None:
        """Queue sampling for a launched step, feed its tokens to the next step, start their copy home.

        Runs after the previous step's tokens were processed, so penalties, seeds and constraint
        masks see every earlier token of each request.
        """
        batch, logits = step.batch, step.logits
        with torch.inference_mode():
            last_logits = logits
            rows = batch.last_logit_rows()
            if rows != list(range(logits.shape[0])):  # not one row per request, as in decode: select them
                last_logits = logits.index_select(0, to_device(torch.tensor(rows, dtype=torch.int64), logits.device))
            sampling = SamplingBatch.from_reqs(batch.reqs, self.runner.vocab_size, self.runner.device)
            result = self.sampler(last_logits, sampling, vocab_mask=self._vocab_mask(batch))
            self.next_input_ids.record(step.forward_batch.req_pool_indices, result.next_token_ids)
            tensors = {"next_ids": result.next_token_ids, "logprobs": result.logprobs,
                       "top_values": None, "top_ids": None}
            if result.top_logprobs is not None:
                tensors["top_values"], tensors["top_ids"] = result.top_logprobs
            tensors.update(self._input_logprob_tensors(batch, logits))
        step.results = HostCopy(tensors)
        step.logits = None

    def _vocab_mask(self, batch: ScheduleBatch) -> torch.Tensor | None:
        """Hook right before sampling: the allowed-token mask of constrained rows (None: no constraints).

        By now the previous step's tokens have been processed, so per-request constraint state is current;
        the mask is built on the host while the device still runs this step's forward.
        """
        return self.grammar.vocab_mask(batch.reqs)

    def _settle(self) -> None:
        """Read the step in flight (waiting for its tokens) and queue its outputs."""
        step, self._inflight = self._inflight, None
        if step is not None:
            self._process(step)
