"""Scheduler: continuous batching over one ModelRunner.

Each ``step()`` either admits waiting requests into an extend (prefill) batch —
in the order the schedule policy picks, reusing radix-cache prefixes, chunking
long prompts — or decodes one token for every running request. When decode
cannot get KV memory the newest requests are retracted to the queue; their
computed tokens stay in the prefix cache and are recomputed only if evicted.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from treadle.core.config import ServerConfig, validate_plugin_choices
from treadle.core.forward_batch import ForwardMode
from treadle.core.hub import default_served_name
from treadle.core.model_runner import ModelRunner
from treadle.core.radix_cache import NoPrefixCache, PrefixCache, RadixCache
from treadle.core.registry import Registry, build_registry
from treadle.core.request import FinishReason, InvalidRequestError, Req, ReqOutput
from treadle.core.sampler import Sampler, SamplingBatch
from treadle.core.schedule_batch import BatchEntry, ScheduleBatch
from treadle.core.tokenizer import eos_token_ids, load_tokenizer

logger = logging.getLogger(__name__)

_EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)
# A waiting request whose next this-many uncached tokens equal those of a request
# admitted in the same batch waits one step and then reuses them from the cache.
IN_BATCH_PREFIX_TOKENS = 32


class Scheduler:
    """Admits, batches, runs and finishes requests; the same object backs Engine and the server."""

    def __init__(self, config: ServerConfig, registry: Registry | None = None) -> None:
        self.config = config
        self.registry = registry if registry is not None else build_registry(config.plugins)
        validate_plugin_choices(config, self.registry)
        self.runner = ModelRunner(config, self.registry)
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

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self._pending: list[ReqOutput] = []
        self.new_token_ratio = config.scheduler.new_token_ratio
        self.num_retractions = 0
        self.num_finished = 0
        self.cached_tokens_total = 0

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

    def add_request(self, req: Req) -> None:
        """Queue a request; raises InvalidRequestError when it can never run."""
        req.sampling_params.verify()
        prompt_len = len(req.origin_input_ids)
        if prompt_len == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if prompt_len >= self.context_len:
            raise InvalidRequestError(
                f"the prompt has {prompt_len} tokens but the model's context length is {self.context_len}; "
                "shorten the prompt", param="prompt")
        if prompt_len + 1 > self.allocator.total_slots:
            raise InvalidRequestError(
                f"the prompt has {prompt_len} tokens but the KV cache holds only {self.allocator.total_slots}; "
                "raise cache.max_total_tokens", param="prompt")
        vocab = self.runner.vocab_size
        if min(req.origin_input_ids) < 0 or max(req.origin_input_ids) >= vocab:
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="input_ids")
        if any(r.rid == req.rid for r in self._live_reqs()):
            raise InvalidRequestError(f"request id {req.rid!r} is already in use", param="rid")
        room = self.context_len - prompt_len
        if req.sampling_params.max_new_tokens > room:
            req.sampling_params.max_new_tokens = room
        self.waiting.append(req)

    def abort_request(self, rid: str) -> ReqOutput | None:
        """Stop a request wherever it is and free its memory."""
        for req in self._live_reqs():
            if req.rid == rid:
                break
        else:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            if req is self.chunked_req:
                self.chunked_req = None
            if req in self.running:
                self.running.remove(req)
            self._release(req)
        req.finish(FinishReason.ABORT, "aborted")
        return self._output(req, [])

    def step(self) -> list[ReqOutput]:
        """Run one batch; outputs for every request that produced tokens or finished."""
        outputs, self._pending = self._pending, []
        batch = self._prefill_batch()
        if batch is None and self.running:
            batch = self._decode_batch()
        if batch is None:
            return outputs
        outputs.extend(self._run(batch))
        return outputs

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req or self._pending)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests hold memory."""
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
            "waiting": len(self.waiting),
            "retractions": self.num_retractions,
            "finished": self.num_finished,
            "cached_tokens_total": self.cached_tokens_total,
        }

    # ------------------------------------------------------------ batch building

    def _prefill_batch(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        cfg = self.config.scheduler
        budget = cfg.chunked_prefill_size or cfg.max_prefill_tokens
        entries: list[BatchEntry] = []
        if self.chunked_req is not None:
            req = self.chunked_req
            extend = min(req.seq_len - req.kv_len, budget)
            entries.append(BatchEntry(req, req.kv_len, extend, _EMPTY_SLOTS, write_from=req.kv_len))
        elif self.waiting:
            self._admit(entries, budget)
        if not entries:
            return None

        need = sum(self.allocator.slots_needed(e.kv_start, e.extend_len) for e in entries)
        slots = self._alloc(
            lambda: self.allocator.alloc_extend(
                [e.kv_start for e in entries], [e.extend_len for e in entries],
                [self._last_slot(e.req) for e in entries]),
            need,
        )
        if slots is None:  # admission checked memory, so this is rare: undo and wait for memory
            self._undo_admission(entries)
            return None
        self._assign_slots(entries, slots)
        for entry in entries:
            req = entry.req
            if self._wants_input_logprobs(req):
                low = max(entry.kv_start, req.logprob_start_len - 1, 0)
                entry.logit_positions = range(low, entry.kv_start + entry.extend_len)
            else:
                end = entry.kv_start + entry.extend_len
                entry.logit_positions = range(end - 1, end)
        mode = ForwardMode.EXTEND
        if cfg.enable_mixed_chunk and self.running:
            decode = self._decode_entries(allow_retract=False)
            if decode:
                entries.extend(decode)
                mode = ForwardMode.MIXED
        return ScheduleBatch(mode, entries)

    def _admit(self, entries: list[BatchEntry], budget: int) -> None:
        cfg = self.config.scheduler
        reserve = self._decode_reserve()
        admitted_need = 0
        for req in self.policy.order(self.waiting, self.tree_cache):
            if len(self.running) + len(entries) >= cfg.max_running_requests or budget <= 0:
                break
            if self.req_to_token_pool.free_count <= len(entries):
                break
            prefix_slots, node = self.tree_cache.match_prefix(req.all_ids)
            prefix_len = self._usable_prefix(req, len(prefix_slots))
            if self._shares_uncached_prefix(req, prefix_len, entries):
                continue  # computed once by the request already admitted, then reused from the cache
            remaining = req.seq_len - prefix_len
            extend = min(remaining, budget)
            if cfg.chunked_prefill_size is None and extend < remaining:
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
            entries.append(BatchEntry(req, prefix_len, extend, _EMPTY_SLOTS, write_from=0))
            admitted_need += need + future
            budget -= extend
            if extend < remaining:
                self.chunked_req = req
                break
        admitted = {id(e.req) for e in entries}
        self.waiting = [req for req in self.waiting if id(req) not in admitted]

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
        for entry in entries:
            req = entry.req
            if req is self.chunked_req and entry.write_from > 0:
                continue  # a continuing chunk keeps what it has
            self.tree_cache.dec_lock_ref(req.last_node)
            self.req_to_token_pool.free(req.req_pool_idx)
            req.req_pool_idx, req.last_node, req.prefix_len, req.kv_slots = None, None, 0, _EMPTY_SLOTS
            if req is self.chunked_req:
                self.chunked_req = None
            self.waiting.insert(0, req)

    def _decode_batch(self) -> ScheduleBatch | None:
        entries = self._decode_entries(allow_retract=True)
        return ScheduleBatch(ForwardMode.DECODE, entries) if entries else None

    def _decode_entries(self, allow_retract: bool) -> list[BatchEntry]:
        while self.running:
            reqs = self.running
            need = sum(self.allocator.slots_needed(req.kv_len, 1) for req in reqs)
            if need <= self.allocator.free_slots + self.tree_cache.evictable_size():
                break
            if not allow_retract:
                return []
            if len(reqs) == 1:
                # Nothing left to retract: the pool cannot hold this one sequence any longer.
                req = reqs[0]
                req.finish(FinishReason.LENGTH, "the KV cache is full")
                self.running.remove(req)
                self._finish(req)
                self._pending.append(self._output(req, []))
                return []
            self._retract(max(reqs, key=lambda r: r.arrival))
        if not self.running:
            return []
        reqs = list(self.running)
        need = sum(self.allocator.slots_needed(req.kv_len, 1) for req in reqs)
        slots = self._alloc(
            lambda: self.allocator.alloc_decode([r.kv_len for r in reqs], [self._last_slot(r) for r in reqs]), need
        )
        assert slots is not None, "decode allocation failed after eviction"
        entries = [BatchEntry(req, req.kv_len, 1, _EMPTY_SLOTS, write_from=req.kv_len) for req in reqs]
        self._assign_slots(entries, slots)
        for entry in entries:
            entry.logit_positions = range(entry.kv_start, entry.kv_start + 1)
        self.new_token_ratio = max(self.config.scheduler.new_token_ratio, self.new_token_ratio - 0.002)
        return entries

    # ------------------------------------------------------------------ running

    def _run(self, batch: ScheduleBatch) -> list[ReqOutput]:
        batch.write_req_to_token(self.req_to_token_pool.req_to_token)
        forward_batch = batch.to_forward_batch(self.runner)
        logits = self.runner.forward(forward_batch)
        last_rows = torch.tensor(batch.last_logit_rows(), device=logits.device)
        reqs = batch.reqs
        with torch.inference_mode():
            sampling = SamplingBatch.from_reqs(reqs, self.runner.vocab_size, self.runner.device)
            result = self.sampler(logits.index_select(0, last_rows), sampling)
            input_logprobs = self._input_logprobs(batch, logits)
        # The one host sync of the step: the sampled ids (and log-probs) come back together.
        next_ids = result.next_token_ids.tolist()
        token_logprobs = result.logprobs.tolist() if result.logprobs is not None else None
        top = None
        if result.top_logprobs is not None:
            top = (result.top_logprobs[0].tolist(), result.top_logprobs[1].tolist())

        outputs = []
        for i, entry in enumerate(batch.entries):
            req = entry.req
            pending_input_lp = input_logprobs.get(id(req))
            if pending_input_lp is not None:
                req.input_token_logprobs.extend(pending_input_lp[0])
                req.input_top_logprobs.extend(pending_input_lp[1])
            if not entry.completes_sequence:
                continue  # a middle chunk: nothing to sample yet
            if req is self.chunked_req:
                self.chunked_req = None
            first_output = not req.output_ids and not req.input_logprobs_sent
            new_ids: list[int] = []
            if self._remaining_new_tokens(req) > 0:
                token = next_ids[i]
                req.output_ids.append(token)
                new_ids.append(token)
                if req.return_logprob and token_logprobs is not None:
                    req.output_token_logprobs.append(token_logprobs[i])
                    if req.top_logprobs_num and top is not None:
                        k = req.top_logprobs_num
                        req.output_top_logprobs.append(list(zip(top[1][i][:k], top[0][i][:k])))
                self._check_finished(req, token)
            else:
                req.finish(FinishReason.LENGTH, None)
            if req.finished:
                if req in self.running:
                    self.running.remove(req)
                self._finish(req)
            elif req not in self.running:
                self._share_prompt(req)
                self.running.append(req)
            outputs.append(self._output(req, new_ids, include_input_logprobs=first_output))
        return outputs

    def _input_logprobs(self, batch: ScheduleBatch, logits: torch.Tensor) -> dict[int, tuple[list, list]]:
        """Log-probs of prompt tokens for requests that asked for them, keyed by id(req)."""
        wanted = [(e, start) for e, start in zip(batch.entries, _row_starts(batch)) if self._wants_input_logprobs(e.req)]
        if not wanted:
            return {}
        result = {}
        for entry, row_start in wanted:
            req = entry.req
            prompt_len = len(req.origin_input_ids)
            positions = [p for p in entry.logit_positions if p + 1 < prompt_len]
            values: list[float | None] = []
            tops: list = []
            if req.logprob_start_len == 0 and entry.kv_start == 0:
                values.append(None)  # the first token has no context to be predicted from
                tops.append(None)
            if positions:
                rows = torch.arange(row_start, row_start + len(positions), device=logits.device)
                targets = torch.tensor([req.origin_input_ids[p + 1] for p in positions], device=logits.device)
                log_probs = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
                values.extend(log_probs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist())
                if req.top_logprobs_num:
                    top = torch.topk(log_probs, req.top_logprobs_num, dim=-1)
                    tops.extend(list(zip(ids, vals)) for ids, vals in zip(top.indices.tolist(), top.values.tolist()))
                else:
                    tops.extend([None] * len(positions))
            result[id(req)] = (values, tops)
        return result

    def _check_finished(self, req: Req, token: int) -> None:
        params = req.sampling_params
        if token in params.stop_token_ids:
            req.finish(FinishReason.STOP, str(token))
        elif not params.ignore_eos and token in self.eos_token_ids:
            req.finish(FinishReason.STOP, str(token))
        elif params.stop and self.tokenizer is not None and (matched := self._matched_stop(req)) is not None:
            req.finish(FinishReason.STOP, matched)
        elif len(req.output_ids) >= params.max_new_tokens:
            req.finish(FinishReason.LENGTH, None)
        elif req.seq_len >= self.context_len:
            req.finish(FinishReason.LENGTH, None)

    def _matched_stop(self, req: Req) -> str | None:
        stops = req.sampling_params.stop
        longest = max(len(s) for s in stops)
        tail = self.tokenizer.decode(req.output_ids[-(longest + 2):], skip_special_tokens=False)
        for stop in stops:
            if stop in tail:
                return stop
        return None

    # ------------------------------------------------------------------ memory

    def _share_prompt(self, req: Req) -> None:
        """Put a just-prefilled prompt in the prefix cache so requests admitted later reuse it."""
        before = req.kv_slots
        self.tree_cache.cache_unfinished_req(req)
        if req.kv_slots is before or torch.equal(req.kv_slots, before):
            return
        # Some pages were already cached by another request: point the table at the cached copies.
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        row[: req.kv_len] = req.kv_slots.to(device=row.device, dtype=row.dtype)

    def _alloc(self, allocate, need: int) -> torch.Tensor | None:
        shortfall = need - self.allocator.free_slots
        if shortfall > 0:
            self.tree_cache.evict(shortfall)
        return allocate()

    def _assign_slots(self, entries: list[BatchEntry], slots: torch.Tensor) -> None:
        offset = 0
        for entry in entries:
            entry.new_slots = slots[offset:offset + entry.extend_len]
            offset += entry.extend_len
            entry.req.kv_slots = torch.cat([entry.req.kv_slots, entry.new_slots])

    def _last_slot(self, req: Req) -> int:
        return int(req.kv_slots[-1]) if req.kv_len else -1

    def _release(self, req: Req) -> None:
        """Hand a request's KV to the prefix cache (or free it) and its table row back."""
        self.tree_cache.cache_finished_req(req)
        if req.req_pool_idx is not None:
            self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_slots = _EMPTY_SLOTS
        req.prefix_len = 0
        req.last_node = None

    def _finish(self, req: Req) -> None:
        self._release(req)
        self.num_finished += 1

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self._release(req)
        req.retractions += 1
        self.num_retractions += 1
        self.waiting.insert(0, req)
        # Admit more cautiously for a while, so the same requests are not retracted again at once.
        self.new_token_ratio = 1.0
        logger.info("retracted request %s (%d tokens) to free KV memory", req.rid, req.seq_len)

    def _decode_reserve(self) -> int:
        return int(sum(self._remaining_new_tokens(req) for req in self.running) * self.new_token_ratio)

    def _remaining_new_tokens(self, req: Req) -> int:
        return max(0, req.sampling_params.max_new_tokens - len(req.output_ids))

    def _usable_prefix(self, req: Req, matched: int) -> int:
        limit = req.seq_len - 1  # at least one token is computed, to produce logits
        if self._wants_input_logprobs(req):
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        usable = min(matched, limit)
        return usable - usable % self.page_size

    def _wants_input_logprobs(self, req: Req) -> bool:
        return (req.return_logprob and req.logprob_start_len >= 0 and not req.input_logprobs_sent
                and not req.output_ids and req.logprob_start_len < len(req.origin_input_ids))

    def _live_reqs(self) -> list[Req]:
        live = self.waiting + self.running
        if self.chunked_req is not None and self.chunked_req not in live:
            live.append(self.chunked_req)
        return live

    def _output(self, req: Req, new_ids: list[int], include_input_logprobs: bool = False) -> ReqOutput:
        output = ReqOutput(
            rid=req.rid,
            new_token_ids=new_ids,
            finished_reason=req.finished_reason,
            finished_detail=req.finished_detail,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
        )
        if req.return_logprob:
            count = len(new_ids)
            output.new_output_logprobs = req.output_token_logprobs[len(req.output_token_logprobs) - count:] if count else []
            if req.top_logprobs_num:
                output.new_output_top_logprobs = req.output_top_logprobs[-count:] if count else []
            if include_input_logprobs or (req.finished and not req.input_logprobs_sent):
                output.input_token_logprobs = list(req.input_token_logprobs)
                output.input_top_logprobs = list(req.input_top_logprobs)
                req.input_logprobs_sent = True
        return output


def _row_starts(batch: ScheduleBatch) -> list[int]:
    starts, offset = [], 0
    for entry in batch.entries:
        starts.append(offset)
        offset += len(entry.logit_positions)
    return starts
