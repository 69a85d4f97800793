"""Scheduler: continuous batching over one model worker, with overlap scheduling.

Each ``step()`` either admits waiting requests into an extend (prefill) batch —
in the order the schedule policy picks, reusing radix-cache prefixes, chunking
long prompts — or decodes one token for every running request (with a
speculative worker, whose ``decode_tokens_per_req`` is k + 1, verifies up to k
drafts per request in a TARGET_VERIFY step). When decode cannot get KV memory
the newest requests are retracted to the queue; their computed tokens stay in
the prefix cache and are recomputed only if evicted.

Overlap (on unless ``scheduler.disable_overlap``): a step builds and queues
batch N+1 while the device still runs batch N, then reads N's sampled tokens
(they were copied to the host in the background), then queues N+1's sampling.
Decode inputs come from the device, so no token waits for the host before it
is fed back. A verify step adds a number of tokens per request known only from
its results, so when N is one the host waits for N's results before building
N+1 and appends N's tokens after queueing N+1's forward, unless N+1 can be an overlapped verify step (its
positions and drafts computed on the device from N's acceptance: ``DecodeManager.overlapped_verify_batch``,
``speculative.overlap``), queued before N is read. The device work is the
worker's (core/execution/worker.py): the scheduler hands it each batch and reads
back the sampled ids.

The scheduler is composed of parts that each own one job, sharing the request
queues through one ``SchedulerState`` (state.py): ``PrefillManager``
(prefill.py: admission), ``DecodeManager`` (decode.py), ``RequestLifecycle``
(lifecycle.py: start, retract, finish, abort), ``KVMemory`` (kv_memory.py) and
``OutputProcessing`` (output.py). Step observers (observers.py) follow a step's
events; docs/scheduling.md describes the loop.
"""

from __future__ import annotations

import logging
import warnings
from functools import cached_property
from typing import Any

import torch

from treadle.core import validation
from treadle.core.config import ServerConfig, validate_plugin_choices
from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.execution.model_runner import ModelRunner
from treadle.core.execution.overlap import LaunchedStep
from treadle.core.execution.embedding_worker import EmbeddingWorker
from treadle.core.execution.worker import ModelWorker, Worker
from treadle.core.grammar import GrammarManager
from treadle.core.loading.hub import default_served_name
from treadle.core.multimodal import inputs as multimodal
from treadle.core.registry import Registry, build_registry
from treadle.core.request import InvalidRequestError, Req, ReqOutput, next_arrival
from treadle.core.scheduling.decode import DecodeManager
from treadle.core.scheduling.embedding_output import EmbeddingOutputs
from treadle.core.scheduling.kv_memory import KVMemory
from treadle.core.scheduling.lifecycle import RequestLifecycle
from treadle.core.scheduling.observers import StepObserver
from treadle.core.scheduling.oom import OomBackoff, retract_after_oom
from treadle.core.scheduling.output import OutputProcessing
from treadle.core.scheduling.prefill import IN_BATCH_PREFIX_TOKENS, PrefillManager
from treadle.core.scheduling.schedule_batch import ScheduleBatch
from treadle.core.scheduling.state import SchedulerState, wants_input_logprobs
from treadle.core.speculative.worker import build_worker
from treadle.text.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["IN_BATCH_PREFIX_TOKENS", "Scheduler"]


class Scheduler:
    """Admits, batches, runs and finishes requests; the same object backs Engine and the server."""

    def __init__(self, config: ServerConfig, registry: Registry | None = None, worker: Worker | None = None,
                 offline: bool = False) -> None:
        self.registry = registry if registry is not None else build_registry(config.plugins)
        validate_plugin_choices(config, self.registry)
        # The model side (core/execution/worker.py); another Worker (a speculative one) may be handed in.
        self.worker: Worker = worker if worker is not None else build_worker(config, self.registry, offline=offline)
        self.config = self.worker.config  # every "auto" resolved; the caller's config stays as it was
        self.embeds = self.config.model.task == "embed"
        if self.embeds and isinstance(self.worker, ModelWorker):
            self.worker = EmbeddingWorker(self.worker, self.registry.get("poolings", self.config.model.pooling)())
        info = self.worker.info
        self.memory = KVMemory.for_worker(info, self.config.cache.disable_radix_cache)
        self.policy = self.registry.get("schedule_policies", config.scheduler.policy)(config.scheduler.seed)
        self.tokenizer = load_tokenizer(config.model.tokenizer_path or info.model_dir)
        self.eos_token_ids = eos_token_ids(info.hf_config, info.model_dir, self.tokenizer)
        self.context_len = info.context_len
        self.grammar = GrammarManager.from_config(config, self.registry, self.tokenizer, info.vocab_size,
                                                  self.eos_token_ids, info.device)
        self.oom_backoff = OomBackoff()

        self.state = SchedulerState(new_token_ratio=self.config.scheduler.new_token_ratio)
        self.lifecycle = RequestLifecycle(self.state, self.memory, self.grammar)
        # Above 1 a decode step verifies drafts (a speculative worker): see _read_positions.
        self.decode_tokens_per_req = int(self.worker.decode_tokens_per_req)
        if self.decode_tokens_per_req < 1:
            raise ValueError(f"{type(self.worker).__name__}.decode_tokens_per_req must be at least 1 (1: plain "
                             f"decode, k + 1: verify k drafts), got {self.decode_tokens_per_req}")
        self.decode_manager = DecodeManager(self.config, self.state, self.memory, self.lifecycle, self.context_len,
                                            settle=self.settle, tokens_per_req=self.decode_tokens_per_req,
                                            tokens_for=self.worker.decode_tokens_for,
                                            overlaps_verify=self.worker.overlaps_verify if self.overlap else None)
        self.prefill_manager = PrefillManager(self.config, self.state, self.memory, self.decode_manager,
                                              self.policy, self.oom_backoff)
        self.output_processing = OutputProcessing(self.state, self.lifecycle, self.grammar, self.eos_token_ids,
                                                  self.tokenizer, self.context_len)
        self.embedding_outputs = EmbeddingOutputs(self.state, self.lifecycle, self.worker.pooling,
                                                  self.config.model.normalize_embeddings) if self.embeds else None
        self._inflight: LaunchedStep | None = None  # queued on the device, its tokens not read yet
        for observer in self.worker.step_observers():
            self.add_observer(observer)

    # ----------------------------------------------------------------- public API

    @property
    def runner(self) -> ModelRunner:
        """Deprecated (kept for a release): the model runner behind the worker. Read ``worker.info`` for the model
        and memory facts, ``worker.runner`` for the runner itself."""
        warnings.warn("Scheduler.runner is deprecated: read scheduler.worker.info (model and memory facts) or "
                      "scheduler.worker.runner", DeprecationWarning, stacklevel=2)
        return self.worker.runner  # type: ignore[attr-defined]

    @property
    def model_info(self) -> dict[str, Any]:
        info = self.worker.info
        return {
            "model_path": info.model_dir,
            "served_model_name": (self.config.model.served_model_name
                                  or default_served_name(self.config.model.path, info.model_dir)),
            "architecture": info.hf_config.architectures[0],
            "context_len": self.context_len,
            "vocab_size": info.vocab_size,
            "eos_token_ids": sorted(self.eos_token_ids),
            "dtype": str(info.dtype).removeprefix("torch."),
            "device": str(info.device),
            "has_tokenizer": self.tokenizer is not None,
            "task": self.config.model.task,
            **({"embedding": self.embedding_info} if self.embeds else {}),
        }

    @property
    def embedding_info(self) -> dict[str, Any]:
        """An embedding model's vector: its size, pooling, normalization and whether it may be truncated."""
        model = self.config.model
        return {"dimensions": int(self.worker.info.hf_config.hidden_size), "pooling": model.pooling,
                "normalize": model.normalize_embeddings, "matryoshka": model.matryoshka}

    @cached_property
    def request_limits(self) -> validation.RequestLimits:
        """What every request must fit (the HTTP process gets them through ``model_info``)."""
        return validation.RequestLimits(context_len=self.context_len, vocab_size=self.worker.info.vocab_size,
                                        kv_slots=self.allocator.total_slots,
                                        max_request_tokens=self.config.server.max_request_tokens)

    def add_request(self, req: Req) -> None:
        """Queue a request; raises InvalidRequestError when it can never run (:meth:`check_request`)."""
        self.check_request(req)
        if req.multimodal is not None:
            multimodal.prepare_request(req, self.worker.info.multimodal_positions, self.worker.info.vocab_size)
        if req.wants_embedding:
            req.hidden_states_from = self.worker.pooling.first_needed_position(len(req.origin_input_ids))
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
        req.lora_uid = self._adapter_uid(req.lora_name)
        validation.check_task(req.wants_embedding, self.config.model.task)
        if req.multimodal is not None:
            multimodal.check_request(req, self.worker.info.multimodal_positions)
        live = self.live_by_rid.get(req.rid)
        if live is not None and not live.finished:
            raise InvalidRequestError(f"request id {req.rid!r} is already in use", param="rid")
        self.grammar.check(req)

    def _adapter_uid(self, name: str | None) -> int | None:
        """The registration of the adapter ``name`` (None for the base model); InvalidRequestError naming the
        loaded adapters when it is unknown."""
        if name is None:
            return None
        lora = self.lora
        if lora is None:
            raise InvalidRequestError(f"unknown LoRA adapter {name!r}: this server serves no adapters (no lora "
                                      "section in its config)", param="lora_path")
        try:
            known = lora.lookup(name)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="lora_path") from None
        if name in lora.unloading:
            raise InvalidRequestError(f"LoRA adapter {name!r} is being unloaded", param="lora_path")
        return known.uid

    @property
    def lora(self):
        """The LoRA adapters (core/lora/manager.py), or None when the config has no lora section."""
        return self.worker.info.lora

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the adapter at ``path`` as ``name`` from now on (LoRAAdapterError, a ValueError, when it cannot)."""
        if self.lora is None:
            raise InvalidRequestError("this server serves no LoRA adapters: start it with a lora section",
                                      param="lora_name")
        self.lora.add(name, path)

    def unload_lora_adapter(self, name: str) -> bool:
        """Stop serving ``name``: False while requests queued or running still use it (call again later); raises
        when it is unknown."""
        if self.lora is None:
            raise InvalidRequestError("this server serves no LoRA adapters", param="lora_name")
        self.lora.lookup(name)
        self.lora.unloading.add(name)  # new requests for it are refused from now on
        if any(req.lora_name == name for req in self.live_by_rid.values()):
            return False
        self.lora.remove(name)
        return True

    def abort_request(self, rid: str) -> ReqOutput | None:
        """Stop a request wherever it is and free its memory."""
        req = self.live_by_rid.get(rid)
        if req is None or req.finished:
            return None
        output = self.lifecycle.abort(req)
        if self._inflight is not None and all(e.req.finished for e in self._inflight.batch.entries):
            self._inflight = None  # every token it computes would be discarded: nothing left to read
        return output

    def step(self) -> list[ReqOutput]:
        """Run one batch; outputs for every request that produced tokens or finished.

        With overlap the outputs are those of the previous batch: this one is still on the device.
        """
        observers = self.state.observers
        if observers:
            observers.step_started()
        batch = None
        if self.decode_tokens_per_req > 1 and self._inflight is not None:
            # A verify step in flight: queue the next one before reading it where its inputs can come from the
            # device (DecodeManager.overlapped_verify_batch), else wait for how far each request got.
            batch = self.decode_manager.overlapped_verify_batch(self._inflight)
            if batch is None:
                self._read_positions()
        if batch is None:
            batch = self.prefill_manager.build_batch()
        if batch is None and self.state.running:
            batch = self.decode_manager.build_batch()
        if observers:
            observers.batch_built(batch)
        launched = None
        if batch is not None:
            if observers:
                observers.forward_launching(batch)
            launched = self._launch_forward(batch)
            if observers:
                observers.forward_launched(batch, launched)
        self.settle()
        if launched is not None:
            if observers:
                observers.sampling_launching(launched)
            self._launch_sampling(launched)
            if observers:
                observers.sampling_launched(launched)
            self._inflight = launched
            if not self.overlap:
                self.settle()
        outputs = self.state.take_outputs()
        if observers:
            observers.step_ended(outputs)
        return outputs

    def settle(self) -> bool:
        """Read the step in flight (waiting for its tokens) and queue its outputs; False when none was in flight."""
        step, self._inflight = self._inflight, None
        if step is None:
            return False
        host = self._wait(step)
        if self.embedding_outputs is not None:
            self.embedding_outputs.process(step, host)
        elif self.decode_tokens_per_req > 1 and step.batch.forward_mode is ForwardMode.TARGET_VERIFY:
            self.output_processing.process_verified(step, host)
        else:
            self.output_processing.process(step, host)
        if self.state.observers:
            self.state.observers.step_settled(step)
        return True

    def _wait(self, step: LaunchedStep) -> dict[str, Any]:
        """``step``'s results on the host (waiting for the device unless they arrived already)."""
        observers = self.state.observers
        if observers:
            observers.results_waiting(step)
        host = step.results.wait()
        if observers:
            observers.results_arrived(step)
        return host

    def _read_positions(self) -> None:
        """Before building a batch, wait for a verify step in flight and take how many tokens each of its requests
        gained (``OutputProcessing.take_positions``): the next step's positions depend on it. Its tokens are
        appended as usual, in ``settle`` after the next forward is queued, so that host work still overlaps the
        device. Any other step adds one token per request: the next batch is built without waiting for it."""
        step = self._inflight
        if step.batch.forward_mode is not ForwardMode.TARGET_VERIFY:
            return
        self.output_processing.take_positions(step, self._wait(step))

    def has_work(self) -> bool:
        state = self.state
        return bool(state.waiting or state.running or state.chunked_req or state.outputs or self._inflight)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests hold memory."""
        self.settle()
        if self.state.running or self.state.chunked_req:
            return False
        self.memory.clear()
        return True

    def kv_stats(self) -> dict[str, int]:
        state = self.state
        return {
            **self.memory.stats(),
            "running": len(state.running) + (1 if state.chunked_req else 0),
            "live_requests": len(state.live_by_rid),
            "waiting": len(state.waiting),
            "retractions": state.num_retractions,
            "finished": state.num_finished,
            "cached_tokens_total": state.cached_tokens_total,
            "oom_retries": self.oom_backoff.count,
        }

    def add_observer(self, observer: StepObserver) -> None:
        """Tell ``observer`` of every step's events from now on (core/scheduling/observers.py)."""
        self.state.observers.append(observer)

    def remove_observer(self, observer: StepObserver) -> None:
        """Stop telling ``observer`` (nothing happens when it is not registered)."""
        if observer in self.state.observers:
            self.state.observers.remove(observer)

    # ------------------------------------------------------------ state the API and callers read

    @property
    def overlap(self) -> bool:
        return not self.config.scheduler.disable_overlap

    @property
    def waiting(self) -> list[Req]:
        return self.state.waiting

    @property
    def running(self) -> list[Req]:
        return self.state.running

    @property
    def chunked_req(self) -> Req | None:
        return self.state.chunked_req

    @property
    def live_by_rid(self) -> dict[str, Req]:
        """Every queued or running request by id; finished ones leave it."""
        return self.state.live_by_rid

    @property
    def inflight(self) -> LaunchedStep | None:
        """The step queued on the device whose tokens were not read yet."""
        return self._inflight

    @property
    def allocator(self):
        return self.memory.allocator

    @property
    def req_to_token_pool(self):
        return self.memory.req_to_token_pool

    @property
    def tree_cache(self):
        return self.memory.tree_cache

    @property
    def page_size(self) -> int:
        return self.memory.page_size

    # ------------------------------------------------------------------ running

    def _launch_forward(self, batch: ScheduleBatch) -> LaunchedStep | None:
        """Queue the batch's forward on the device; the host goes on without waiting for it.

        None when the device ran out of memory: the batch was undone, to be retried smaller.
        """
        try:
            step = self.worker.launch_forward(batch)
        except torch.cuda.OutOfMemoryError as exc:
            retract_after_oom(self, batch, exc)
            return None
        self.oom_backoff.on_success()
        if batch.follows is not None:
            batch.follows.followed_by = batch  # reading that step moves this one's slots into place
        # After the forward is queued: sharing a prompt may re-point its table row at cached copies.
        self.lifecycle.commit(batch)
        return step

    def _launch_sampling(self, step: LaunchedStep) -> None:
        """Queue sampling for a launched step, feed its tokens to the next step, start their copy home.

        Runs after the previous step's tokens were processed, so penalties, seeds and constraint
        masks see every earlier token of each request.
        """
        batch = step.batch
        prompt_logprobs = [i for i, entry in enumerate(batch.entries) if wants_input_logprobs(entry.req)]
        self.worker.launch_sampling(step, self._vocab_mask(step), prompt_logprobs)

    def _vocab_mask(self, step: LaunchedStep) -> torch.Tensor | None:
        """Hook right before sampling: the allowed-token mask of constrained rows (None: no constraints); a verify
        step's has a row per verified position (``GrammarManager.verify_mask``).

        By now the previous step's tokens have been processed, so per-request constraint state is current;
        the mask is built on the host while the device still runs this step's forward.
        """
        if step.draft_ids is None:
            return self.grammar.vocab_mask(step.batch.reqs)
        return self.grammar.verify_mask(step.batch.reqs, lambda: _host_draft_ids(step))


def _host_draft_ids(step: LaunchedStep) -> list[list[int]]:
    """A verify step's drafts on the host: from the copy the worker started, else copied now."""
    if step.host_draft_ids is not None:
        return step.host_draft_ids.wait()["ids"].tolist()
    return step.draft_ids.tolist()
