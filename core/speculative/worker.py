"""The speculative worker: a target :class:`ModelWorker` and a :class:`Speculator` behind the one Worker API.

The scheduler sees a worker whose ``decode_tokens_per_req`` is ``k + 1`` and hands it TARGET_VERIFY batches
without drafts (docs/scheduling.md, "Steps of several tokens per request"). For each one the worker asks the
speculator for ``t - 1`` drafts per request and queues the target's forward over them; the target's sampling
keeps, per request, the drafts the target would have produced itself (greedy: equal to its argmax; sampled:
rejection sampling, exact in distribution). Every other batch (prefills, plain decode steps while speculation
is off) goes to the target as it is.

:func:`build_worker` is where a scheduler's worker is made (the Engine, the server's scheduler process and
every tensor-parallel rank go through it): a plain ModelWorker unless ``speculative.method`` names a speculator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from treadle.core.config import ServerConfig
from treadle.core.execution.attention import joins_overlapped_verify
from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.execution.overlap import HostCopy, LaunchedStep
from treadle.core.execution.worker import ModelWorker, Worker
from treadle.core.registry import Registry
from treadle.core.scheduling.observers import StepObserver
from treadle.core.speculative.speculator import Drafts, Speculator
from treadle.core.speculative.tree import chain_parents, warm_up_tree_kernels

if TYPE_CHECKING:
    from treadle.core.request import Req
    from treadle.core.scheduling.schedule_batch import ScheduleBatch


def build_worker(config: ServerConfig, registry: Registry, *, offline: bool = False) -> Worker:
    """The worker ``config`` asks for: a :class:`SpeculativeWorker` when ``speculative.method`` is set, else a
    plain :class:`ModelWorker` (then nothing of speculation runs)."""
    if config.speculative.method is None:
        return ModelWorker(config, registry, offline=offline)
    return SpeculativeWorker(config, registry, offline=offline)


class SpeculativeWorker(Worker):
    """Verifies up to ``speculative.num_tokens`` drafts per request and decode step (module docstring).

    ``target``: the ModelWorker of the served model, built with verify CUDA graphs for every ``t`` of 2 to
    ``k + 1`` (up to ``speculative.max_batch_size`` requests); ``speculator``: the plugin named by
    ``speculative.method``, built by its factory ``factory(target, resolved_config, registry)``.
    """

    def __init__(self, config: ServerConfig, registry: Registry, *, offline: bool = False,
                 speculator: Speculator | None = None) -> None:
        num_tokens = config.speculative.num_tokens
        if config.speculative.topk > 1 and config.attention.backend != "auto":  # before any graph is captured
            check_tree_backend(registry.get("attention", config.attention.backend), config.attention.backend,
                               registry)
        self.target = ModelWorker(config, registry, offline=offline, verify_tokens_per_req=range(2, num_tokens + 2),
                                  verify_trees=config.speculative.topk > 1)
        self.info, self.config = self.target.info, self.target.config
        if speculator is None:
            factory = registry.get("speculators", config.speculative.method)
            speculator = factory(self.target, self.config, registry)
        self.speculator = speculator
        self.num_draft_tokens = max(1, min(num_tokens, int(getattr(speculator, "num_draft_tokens", num_tokens))))
        self.trees = config.speculative.topk > 1
        if self.trees:
            check_tree_backend(self.target.runner.attn_backend, config.attention.backend, registry)
            warm_up_tree_kernels(self.info.device, self.num_draft_tokens)
        self.overlap_verify = overlapped_verify_support(config.speculative.overlap, self)
        self._observer = _ReleasedRequests(speculator)

    @property
    def decode_tokens_per_req(self) -> int:
        return self.num_draft_tokens + 1

    @property
    def runner(self):
        """The target's model runner (what a plain worker's ``runner`` is)."""
        return self.target.runner

    @property
    def cuda_graphs(self):
        """The target's decode and verify CUDA graphs (None on the CPU or with graphs off)."""
        return self.target.cuda_graphs

    def decode_tokens_for(self, reqs: Sequence["Req"]) -> int:
        return 1 + max(0, min(self.num_draft_tokens, int(self.speculator.max_drafts(list(reqs)))))

    def step_observers(self) -> Sequence[StepObserver]:
        return (self._observer,)

    def overlaps_verify(self, num_tokens: int) -> bool:
        if not self.overlap_verify:
            return False
        if self.info.device.type == "cpu":
            return True  # host and device are one: any backend reads the lengths from the tensors for free
        return bool(self.target.runner.attn_backend.verifies_by_decode(ForwardMode.TARGET_VERIFY, num_tokens))

    def launch_forward(self, batch: "ScheduleBatch", draft_ids: torch.Tensor | None = None) -> LaunchedStep:
        if batch.follows is not None:
            step = self.target.launch_forward(batch, propose_drafts=lambda positions, rows: self._propose_on_device(
                batch, positions, rows))
            self.speculator.after_target_forward(step)
            return step
        drafts = parents = None
        if batch.forward_mode is ForwardMode.TARGET_VERIFY and draft_ids is None:
            drafts = self.propose(batch)
            draft_ids = drafts.token_ids
            if self.trees:
                parents = drafts.parents if drafts.parents is not None else chain_parents(*draft_ids.shape,
                                                                                          draft_ids.device)
        host_draft_ids = None
        if draft_ids is not None and any(req.grammar is not None for req in batch.reqs):
            # Constrained rows mask each verified position by walking their matcher through the drafts (the
            # scheduler's vocab mask): the copy starts before the target's forward, so waiting for it does not
            # wait for that forward.
            host_draft_ids = HostCopy({"ids": draft_ids})
        step = self.target.launch_forward(batch, draft_ids, draft_parents=parents)
        step.host_draft_ids = host_draft_ids
        if drafts is not None:
            step.draft_probs = drafts.probs
        self.speculator.after_target_forward(step)
        return step

    def propose(self, batch: "ScheduleBatch") -> Drafts:
        """The speculator's drafts for a verify batch, ``t - 1`` per request, checked for their shape."""
        num_drafts = batch.entries[0].extend_len - 1
        drafts = self.speculator.propose(batch, num_drafts)
        expected = (len(batch.entries), num_drafts)
        if tuple(drafts.token_ids.shape) != expected:
            raise ValueError(f"speculator {type(self.speculator).__name__} proposed drafts of shape "
                             f"{tuple(drafts.token_ids.shape)}; a verify batch of {expected[0]} requests and "
                             f"{num_drafts} drafts each needs {expected}")
        if drafts.parents is not None:
            name = type(self.speculator).__name__
            if not self.trees:
                raise ValueError(f"speculator {name} proposed a draft tree (Drafts.parents) but speculative.topk "
                                 "is 1; set speculative.topk above 1 to verify trees")
            if tuple(drafts.parents.shape) != expected:
                raise ValueError(f"speculator {name} proposed parents of shape {tuple(drafts.parents.shape)}; "
                                 f"its drafts need {expected}")
            if drafts.probs is not None:
                raise ValueError(f"speculator {name} proposed a draft tree with probs: tree drafts are proposals "
                                 "kept by matching the target's own tokens; leave Drafts.probs None")
        return drafts

    def _propose_on_device(self, batch: "ScheduleBatch", positions: torch.Tensor,
                           req_pool_indices: torch.Tensor) -> torch.Tensor:
        """An overlapped verify batch's drafts (``Speculator.propose_on_device``), checked for their shape."""
        num_drafts = batch.entries[0].extend_len - 1
        drafts = self.speculator.propose_on_device(batch, num_drafts, positions, req_pool_indices)
        expected = (len(batch.entries), num_drafts)
        if tuple(drafts.token_ids.shape) != expected or drafts.parents is not None or drafts.probs is not None:
            raise ValueError(f"speculator {type(self.speculator).__name__}.propose_on_device proposed drafts of shape "
                             f"{tuple(drafts.token_ids.shape)}; an overlapped verify batch needs a chain of shape "
                             f"{expected} without parents or probs")
        return drafts.token_ids

    def launch_sampling(self, step: LaunchedStep, vocab_mask: torch.Tensor | None = None,
                        prompt_logprob_entries: Sequence[int] = ()) -> None:
        self.target.launch_sampling(step, vocab_mask, prompt_logprob_entries)

    def release_graphs(self) -> None:
        self.speculator.release_graphs()
        self.target.release_graphs()


def check_tree_backend(backend, name: str, registry: Registry) -> None:
    """Refuse draft trees (``speculative.topk`` > 1) on an attention backend that cannot mask them."""
    if getattr(backend, "supports_tree_mask", False):
        return
    able = [backend_name for backend_name in registry.names("attention")
            if getattr(registry.get("attention", backend_name), "supports_tree_mask", False)]
    raise ValueError(f"speculative.topk > 1 verifies draft trees, which attention backend '{name}' "
                     f"({type(backend).__name__}) cannot mask; use attention.backend: {' or '.join(able)}, or "
                     "speculative.topk: 1")


def overlapped_verify_support(setting: bool | str, worker: SpeculativeWorker) -> bool:
    """Whether verify steps may be overlapped (``speculative.overlap``): ``auto`` where everything it needs is
    there, ``true`` an error naming what is missing."""
    if setting is False:
        return False
    config, missing = worker.config, []
    if config.speculative.topk > 1:
        missing.append("draft chains (speculative.topk 1)")
    if not getattr(worker.speculator, "proposes_on_device", False):
        missing.append(f"a speculator that proposes on the device (Speculator.propose_on_device; "
                       f"'{config.speculative.method}' does not)")
    if worker.info.page_size != 1:
        missing.append(f"page size 1 (cache.page_size is {worker.info.page_size})")
    if config.scheduler.disable_overlap:
        missing.append("overlap scheduling (scheduler.disable_overlap is set)")
    backend = worker.target.runner.attn_backend
    if worker.info.device.type != "cpu" and not joins_overlapped_verify(backend):
        missing.append(f"an attention backend that reads a verify step's lengths on the device "
                       f"(AttentionBackend.verifies_by_decode: triton, flashinfer_triton; not "
                       f"{config.attention.backend})")
    if missing and setting is True:
        raise ValueError("speculative.overlap: true needs " + ", ".join(missing) + "; set speculative.overlap to "
                         "auto or false")
    return not missing


class _ReleasedRequests(StepObserver):
    """Tells the speculator of every request that leaves the running batch (finished, aborted or retracted)."""

    def __init__(self, speculator: Speculator) -> None:
        self.speculator = speculator

    def request_retracted(self, req: "Req") -> None:
        self.speculator.request_released(req)

    def request_finished(self, req: "Req") -> None:
        self.speculator.request_released(req)
