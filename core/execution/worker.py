"""The model worker: the scheduler hands it a batch and gets the sampled tokens back.

A :class:`Worker` is the model side of one rank (SGLang's ``TpModelWorker`` idea): the scheduler decides
which requests run and where their KV goes, the worker turns that into device work. Its API is two calls per
step, both queued on the device without waiting for it (overlap scheduling reads the results one step late):

- ``launch_forward(batch)`` -> a :class:`LaunchedStep` whose logits are on their way (it may raise
  ``torch.cuda.OutOfMemoryError``; the scheduler then retracts and retries smaller);
- ``launch_sampling(step, vocab_mask, prompt_logprob_entries)``: samples, feeds the tokens to the next step
  on the device, and starts copying the sampled ids, log-probs and the prompt log-probs asked for to the host
  (``step.results``).

What the scheduler needs to know about the model and the memory is ``worker.info`` (:class:`WorkerInfo`).
:class:`ModelWorker` is the one implementation: a model runner, a sampler, the CUDA-graph runners and the
device-side next-input-token buffer. Under tensor parallelism every rank runs a scheduler with its own
ModelWorker. A speculative decoder is a Worker that wraps a target ModelWorker and a draft one: it runs the
draft's steps, then the target's TARGET_VERIFY step (``launch_forward(batch, draft_ids)``), whose sampling
returns the target's token at every position and how many drafts each request keeps.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from treadle.core.auto_size import largest_extend_tokens
from treadle.core.config import ServerConfig
from treadle.core.execution.attention_context import AttentionContext
from treadle.core.execution.batch_context import NO_ADAPTER, BatchContext, using_batch_context
from treadle.core.execution.cuda_graph import CudaGraphRunner
from treadle.core.execution.forward_batch import ForwardBatch
from treadle.core.execution.forward_inputs import build_forward_batch
from treadle.core.execution.model_runner import ModelRunner
from treadle.core.execution.overlap import HostCopy, LaunchedStep, NextInputIds, to_device
from treadle.core.execution.piecewise_graph import PiecewiseGraphRunner
from treadle.core.execution.sampler import Sampler, SamplingBatch, accepted_draft_counts
from treadle.core.registry import Registry
from treadle.core.speculative.tree import TreeLayout, compact_kept_path, verify_tree

if TYPE_CHECKING:
    from treadle.core.lora.manager import LoRAManager
    from treadle.core.memory.allocator import KVAllocator
    from treadle.core.memory.pools import ReqToTokenPool
    from treadle.core.request import Req
    from treadle.core.resolved_config import ResolvedConfig
    from treadle.core.scheduling.observers import StepObserver
    from treadle.core.scheduling.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerInfo:
    """What a scheduler reads about its worker's model and KV memory, fixed once the worker is built."""

    model_dir: str
    hf_config: Any
    vocab_size: int
    context_len: int
    device: torch.device
    dtype: torch.dtype
    page_size: int
    max_running_requests: int  # request-table rows the scheduler may fill (one spare row beyond)
    max_total_tokens: int  # KV slots
    allocator: "KVAllocator"
    req_to_token_pool: "ReqToTokenPool"
    lora: "LoRAManager | None" = None  # the adapters (lora section); None: LoRA is off
    # A vision-language model's ``multimodal_positions(prompt_len, items)`` (ModelTraits); None: text only.
    multimodal_positions: Any = None

    @classmethod
    def of(cls, runner: ModelRunner) -> "WorkerInfo":
        return cls(
            model_dir=runner.model_dir, hf_config=runner.hf_config, vocab_size=runner.vocab_size,
            context_len=runner.context_len, device=runner.device, dtype=runner.dtype, page_size=runner.page_size,
            max_running_requests=int(runner.max_running_requests), max_total_tokens=int(runner.max_total_tokens),
            allocator=runner.allocator, req_to_token_pool=runner.req_to_token_pool, lora=runner.lora,
            multimodal_positions=runner.model_traits.multimodal_positions,
        )


class Worker(ABC):
    """The model side of one rank, as the scheduler sees it (see the module docstring)."""

    info: WorkerInfo
    config: "ResolvedConfig"  # the user's config with every "auto" resolved for this model and device

    @property
    def decode_tokens_per_req(self) -> int:
        """The most new tokens a request carries in one decode step: 1 (plain decode), or ``k + 1`` for a worker
        that verifies ``k`` drafts a step. Above 1 the scheduler builds TARGET_VERIFY batches of ``t`` tokens per
        request (``2 <= t <= k + 1``; DECODE batches when ``t`` is 1) and calls ``launch_forward(batch)`` without
        drafts: the worker supplies ``t - 1`` drafts per request itself (docs/scheduling.md)."""
        return 1

    def decode_tokens_for(self, reqs: Sequence["Req"]) -> int:
        """The most tokens per request worth computing in the next decode step of ``reqs`` (1 to
        ``decode_tokens_per_req``); asked only when ``decode_tokens_per_req`` is above 1, before the batch is built."""
        return self.decode_tokens_per_req

    def overlaps_verify(self, num_tokens: int) -> bool:
        """Whether a TARGET_VERIFY step of ``num_tokens`` tokens may be queued before the previous verify step's
        results are read (an overlapped verify batch, ``ScheduleBatch.follows``); False by default."""
        return False

    @abstractmethod
    def launch_forward(self, batch: "ScheduleBatch", draft_ids: torch.Tensor | None = None) -> LaunchedStep:
        """Write the batch's KV slots into the request table and queue its forward. ``draft_ids``
        (``[bs, k]`` on the device): the drafts of a TARGET_VERIFY batch, whose entries carry ``k + 1`` tokens."""

    @abstractmethod
    def launch_sampling(self, step: LaunchedStep, vocab_mask: torch.Tensor | None = None,
                        prompt_logprob_entries: Sequence[int] = ()) -> None:
        """Queue sampling for ``step`` and start its results' copy to the host (``step.results``).
        ``prompt_logprob_entries``: the entries whose prompt log-probs were asked for."""

    def release_graphs(self) -> None:
        """Free the CUDA graphs before the device (or a tensor-parallel group) goes away; later steps run eagerly."""

    def step_observers(self) -> Sequence["StepObserver"]:
        """Step observers the scheduler registers for this worker when it is built (a speculative worker hears
        of requests that finish or are retracted this way); none by default."""
        return ()


class ModelWorker(Worker):
    """A model runner, a sampler, the CUDA graphs that replay the runner's steps and the next-input-token buffer.

    ``verify_tokens_per_req``: the ``k + 1`` of the TARGET_VERIFY steps to capture in CUDA graphs (a speculative
    worker asks for its own; empty: verify steps run eagerly or through the prefill graphs), for batch sizes up to
    ``verify_max_bs`` (None: ``speculative.max_batch_size``, past which a decode step verifies no drafts);
    ``verify_trees``: those steps verify draft trees (their graphs
    take a tree mask). Plain decode is captured as it is without them.
    """

    def __init__(self, config: ServerConfig, registry: Registry, *, offline: bool = False,
                 verify_tokens_per_req: Sequence[int] = (), verify_max_bs: int | None = None,
                 verify_trees: bool = False) -> None:
        self.runner = ModelRunner(config, registry, offline=offline)
        self.config = self.runner.config
        self.context = AttentionContext.of(self.runner)
        self.info = WorkerInfo.of(self.runner)
        self.sampler = Sampler()
        self.next_input_ids = NextInputIds(self.runner.req_to_token_pool.size, self.runner.device)
        self.verify_tokens_per_req = tuple(sorted({int(t) for t in verify_tokens_per_req if int(t) > 1}))
        self.verify_max_bs = verify_max_bs if verify_max_bs is not None else self.config.speculative.max_batch_size
        self.verify_trees = verify_trees  # verify steps carry draft trees (their graphs a tree mask)
        self.cuda_graphs: CudaGraphRunner | None = None
        self.piecewise_graphs: PiecewiseGraphRunner | None = None
        self.capture_graphs()
        if self.runner.lora is not None:  # the LoRA kernels the graphs did not run, compiled now (core/lora/manager.py)
            self.runner.lora.warm_up(largest_step_tokens(self.config, max([1, *self.verify_tokens_per_req])))
        if self.runner.device.type == "cuda":
            embeds = self.config.model.task == "embed"  # no logits: warm up what EmbeddingWorker runs
            self.runner._warm_up_prefill(forward=self.runner.forward_hidden_states if embeds else self.forward)

    # ------------------------------------------------------------------ graphs

    def capture_graphs(self, force: bool = False) -> None:
        """Capture the CUDA graphs the config and the device allow (decode, the verify steps asked for, the
        prefill pieces); nothing on the CPU or with ``runtime.disable_cuda_graph`` (unless ``force``: a
        benchmark that sets a backend's tunables first, on a worker built without graphs). Graphs captured
        before are released first."""
        self.release_graphs()
        runner, runtime = self.runner, self.runner.config.runtime
        if runner.device.type != "cuda" or (runtime.disable_cuda_graph and not force):
            return
        if runner.config.model.task == "embed":
            return  # prefills only, run eagerly (core/execution/embedding_worker.py)
        backend = runner.attn_backend
        if runner.uses_decode_graphs:
            verify = self.verify_tokens_per_req
            if verify and not getattr(backend, "supports_verify_cuda_graph", False):
                logger.info("attention backend %s captures no TARGET_VERIFY graphs; verify steps run without them",
                            runner.config.attention.backend)
                verify = ()
            max_bs = min(runtime.cuda_graph_max_bs, runner.max_running_requests)
            self.cuda_graphs = CudaGraphRunner(runner.model, backend, self.context, max_bs,
                                               prune=bool(runtime.cuda_graph_prune), verify_tokens_per_req=verify,
                                               verify_max_bs=self.verify_max_bs, verify_trees=self.verify_trees)
        else:
            logger.info("attention backend %s has no CUDA-graph support; decode runs eagerly",
                        runner.config.attention.backend)
        tokens = runner.piecewise_graph_tokens
        if tokens:
            pool = self.cuda_graphs.memory_pool if self.cuda_graphs is not None else None
            self.piecewise_graphs = PiecewiseGraphRunner(runner.model, backend, self.context, tokens, pool)
        elif runtime.piecewise_cuda_graph_max_tokens:
            logger.info("model %s has no forward_hidden/compute_logits; prefills run eagerly",
                        type(runner.model).__name__)

    def release_graphs(self) -> None:
        """Free the decode and prefill CUDA graphs once the GPU is done with them; later forwards run eagerly.

        Under tensor parallelism the graphs hold collectives captured on the group's NCCL communicator: rank 0
        hung in ``destroy_process_group`` with the prefill graphs still alive (2 H200s), so each rank calls this
        before leaving the group."""
        graphs = [runner for runner in (self.cuda_graphs, self.piecewise_graphs) if runner is not None]
        if graphs and self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        for runner in graphs:
            runner.release()
        self.cuda_graphs = None
        self.piecewise_graphs = None

    # ------------------------------------------------------------------ steps

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits for ``forward_batch.logits_indices``: through a captured graph where one fits, else eagerly."""
        graphs = self.cuda_graphs
        if graphs is not None:
            if graphs.can_run(forward_batch):
                return graphs.replay(forward_batch)
            if graphs.verify and graphs.can_run_verify(forward_batch):
                return graphs.replay_verify(forward_batch)
        piecewise = self.piecewise_graphs
        if piecewise is not None and piecewise.can_run(forward_batch):
            with using_batch_context(forward_batch.batch_context):  # the eager parts between pieces read it too
                return piecewise.replay(forward_batch)
        return self.runner.forward(forward_batch)

    def launch_forward(self, batch: "ScheduleBatch", draft_ids: torch.Tensor | None = None,
                       draft_parents: torch.Tensor | None = None,
                       propose_drafts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                       ) -> LaunchedStep:
        """``draft_parents`` (``[bs, k]``, with ``draft_ids``): the drafts form trees, each draft's parent draft
        (-1: the request's last token; core/speculative/tree.py), verified under a tree mask. ``propose_drafts``:
        an overlapped verify batch's drafts from its device positions (core/execution/forward_inputs.py)."""
        runner = self.runner
        if not batch.forward_mode.is_verify():  # a verify batch's slots go in with its inputs' one copy
            batch.write_req_to_token(runner.req_to_token_pool.req_to_token)
        tree = TreeLayout.of(draft_parents) if draft_parents is not None else None
        forward_batch = build_forward_batch(batch, self.context, runner.attn_backend, self.next_input_ids,
                                            draft_ids, tree, propose_drafts)
        if draft_ids is None and batch.follows is not None:  # drafted on the device: sampling compares against them
            draft_ids = forward_batch.input_ids.view(forward_batch.batch_size, -1)[:, 1:]
        if runner.lora is not None:
            forward_batch.batch_context = adapter_context(batch, forward_batch, runner.lora.backend.adapter_order_above)
        return LaunchedStep(batch, forward_batch, self.forward(forward_batch), draft_ids=draft_ids, tree=tree)

    def launch_sampling(self, step: LaunchedStep, vocab_mask: torch.Tensor | None = None,
                        prompt_logprob_entries: Sequence[int] = ()) -> None:
        """Sample each request's last logits row (a verify step: every row; ``vocab_mask`` then has a row per
        position), feed the tokens to the next step and start their copy home. The host copy holds
        ``next_ids`` (``[bs]``; verify: ``[bs, k + 1]``), ``logprobs``, ``top_values``/``top_ids``, for a verify
        step ``accepted`` (drafts kept per request), and ``in{i}`` (and ``in{i}_top_ids``/``in{i}_top_values``)
        per entry of ``prompt_logprob_entries``."""
        with torch.inference_mode():
            if step.forward_batch.tokens_per_req == 1:
                tensors = self._sample_last_rows(step, vocab_mask)
            else:
                tensors = self._sample_every_position(step, vocab_mask)
            if prompt_logprob_entries:
                tensors.update(prompt_logprob_tensors(step.batch, step.logits, prompt_logprob_entries))
        step.results = HostCopy(tensors)
        step.logits = None
        if step.kept_path is not None:
            # Queued after the results' copy home, so the host reads them (and builds the next step) while the
            # device moves the kept path's K/V; the next step's kernels run after it on the same stream.
            with torch.inference_mode():
                compact_kept_path(self.runner.kv_cache, step.forward_batch.out_cache_loc, step.kept_path)

    def _sample_last_rows(self, step: LaunchedStep, vocab_mask: torch.Tensor | None) -> dict[str, Any]:
        batch, logits = step.batch, step.logits
        last_logits = logits
        rows = batch.last_logit_rows()
        if rows != list(range(logits.shape[0])):  # not one row per request, as in decode: select them
            last_logits = logits.index_select(0, to_device(torch.tensor(rows, dtype=torch.int64), logits.device))
        sampling = SamplingBatch.from_reqs(batch.reqs, self.info.vocab_size, self.info.device)
        result = self.sampler(last_logits, sampling, vocab_mask=vocab_mask)
        self.next_input_ids.record(step.forward_batch.req_pool_indices, result.next_token_ids)
        tensors = {"next_ids": result.next_token_ids, "logprobs": result.logprobs, "top_values": None, "top_ids": None}
        if result.top_logprobs is not None:
            tensors["top_values"], tensors["top_ids"] = result.top_logprobs
        return tensors

    def _sample_every_position(self, step: LaunchedStep, vocab_mask: torch.Tensor | None) -> dict[str, Any]:
        forward_batch = step.forward_batch
        bs, per_req = forward_batch.batch_size, forward_batch.tokens_per_req
        sampling = SamplingBatch.from_reqs(step.batch.reqs, self.info.vocab_size, self.info.device,
                                           tokens_per_req=per_req)
        if step.tree is not None:
            return self._sample_tree(step, sampling, vocab_mask)
        result = self.sampler(step.logits, sampling, vocab_mask=vocab_mask, draft_ids=step.draft_ids,
                              draft_probs=step.draft_probs)
        token_ids = result.next_token_ids.view(bs, per_req)
        tensors: dict[str, Any] = {"next_ids": token_ids, "top_values": None, "top_ids": None,
                                   "logprobs": result.logprobs.view(bs, per_req) if result.logprobs is not None
                                   else None}
        if result.top_logprobs is not None:
            values, ids = result.top_logprobs
            tensors["top_values"], tensors["top_ids"] = values.view(bs, per_req, -1), ids.view(bs, per_req, -1)
        if step.draft_ids is not None:
            accepted = result.accepted if result.accepted is not None else accepted_draft_counts(step.draft_ids,
                                                                                                   token_ids)
            self.next_input_ids.record_accepted(forward_batch.req_pool_indices, token_ids, accepted)
            tensors["accepted"] = step.accepted = accepted
        return tensors


    def _sample_tree(self, step: LaunchedStep, sampling: SamplingBatch,
                     vocab_mask: torch.Tensor | None) -> dict[str, Any]:
        """A verify step over draft trees (core/speculative/tree.py): the kept path's tokens, log-probs and K/V
        laid out as a chain's, so the scheduler reads it as one."""
        forward_batch = step.forward_batch
        if vocab_mask is not None:
            raise ValueError("grammar masks are not applied to draft trees: a constrained request decodes one token a "
                             "step or verifies chains (speculative.topk 1)")
        verdict = verify_tree(self.sampler, step.logits, sampling, step.tree, step.draft_ids, vocab_mask)
        tensors: dict[str, Any] = {"next_ids": verdict.token_ids, "accepted": verdict.accepted,
                                   "logprobs": verdict.logprobs, "top_values": None, "top_ids": None}
        if verdict.top_logprobs is not None:
            tensors["top_values"], tensors["top_ids"] = verdict.top_logprobs
        self.next_input_ids.record_accepted(forward_batch.req_pool_indices, verdict.token_ids, verdict.accepted)
        step.kept_ids = verdict.token_ids
        step.kept_path = verdict.path
        return tensors


def largest_step_tokens(config: "ResolvedConfig", decode_tokens_per_req: int = 1) -> int:
    """The most tokens one forward step can hold under ``config``: an extend step (a prefill chunk with the decode rows
    a mixed step carries; without chunking, up to ``max_prefill_tokens`` of prompts or one whole prompt) or a decode
    step of every running request, ``decode_tokens_per_req`` tokens each."""
    sched = config.scheduler
    running = sched.max_running_requests
    chunk = sched.chunked_prefill_size or max(sched.max_prefill_tokens, config.model.context_length)
    extend = largest_extend_tokens(chunk, running if sched.enable_mixed_chunk else 0, sched.latency_chunk_size)
    return max(extend, running * decode_tokens_per_req)


def adapter_context(batch: "ScheduleBatch", forward_batch: ForwardBatch,
                    adapter_order_above: int | None) -> BatchContext | None:
    """The batch context carrying each token's adapter slot (``Req.lora_slot``), sorted by slot past
    ``adapter_order_above`` tokens (the LoRA backend's; None: never sorted); None when no request of the batch runs
    an adapter (the deltas then add nothing, eagerly; a graph replays with every row NO_ADAPTER)."""
    slots = [entry.req.lora_slot for entry in batch.entries]
    if all(slot == NO_ADAPTER for slot in slots):
        return None
    ids = to_device(torch.tensor(slots, dtype=torch.int64), forward_batch.input_ids.device)
    return BatchContext.for_batch(forward_batch, ids, adapter_order_above=adapter_order_above)


def prompt_logprob_tensors(batch: "ScheduleBatch", logits: torch.Tensor,
                           entries: Sequence[int]) -> dict[str, torch.Tensor]:
    """Prompt-token log-probs of the batch entries ``entries`` (indices), as device tensors keyed ``in{entry}``
    (with ``in{entry}_top_ids``/``in{entry}_top_values`` where the request wants top log-probs); an entry with no
    prompt position in this step gets an empty tensor."""
    wanted = set(entries)
    tensors: dict[str, torch.Tensor] = {}
    row_start = 0
    for i, entry in enumerate(batch.entries):
        req = entry.req
        if i in wanted:
            prompt_len = len(req.origin_input_ids)
            positions = [p for p in entry.logit_positions if req.logprob_start_len <= p + 1 < prompt_len]
            if positions:
                rows = torch.arange(row_start, row_start + len(positions))
                targets = torch.tensor([req.origin_input_ids[p + 1] for p in positions])
                log_probs = torch.log_softmax(logits.index_select(0, to_device(rows, logits.device)).float(), dim=-1)
                tensors[f"in{i}"] = log_probs.gather(1, to_device(targets, logits.device).unsqueeze(1)).squeeze(1)
                if req.top_logprobs_num:
                    top = torch.topk(log_probs, req.top_logprobs_num, dim=-1)
                    tensors[f"in{i}_top_ids"] = top.indices
                    tensors[f"in{i}_top_values"] = top.values
            else:
                tensors[f"in{i}"] = torch.empty(0)
        row_start += len(entry.logit_positions)
    return tensors
