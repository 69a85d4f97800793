"""The ``draft`` speculator: a small model of the target's tokenizer proposes each request's next tokens.

The draft model (``speculative.draft_model_path``: any family treadle loads, GGUF included) runs in a
:class:`~treadle.core.execution.worker.ModelWorker` of its own on the target's device, with its own KV pool and
request table (no prefix cache), so its decode steps replay its own CUDA graphs. For a verify batch of ``n``
drafts per request it queues, without waiting for the device:

1. one extend step over each request's tokens its KV has not seen yet: the whole prompt the first time, then
   the target's token after the last verify step (and the last draft, when all were kept); its logits at the
   request's last sampled token give the first draft;
2. ``n - 1`` decode steps, each feeding the draft before.

Greedy requests get the argmax; a request that samples gets a token sampled from the draft's distribution
under its temperature/top-k/top-p/min-p, and ``Drafts.probs`` carries those distributions for rejection sampling.

Which tokens the target kept is read off the next batch's positions (``entry.kv_start``), never off the device.
A token the host has not seen yet (overlap scheduling appends a step's tokens one step late) is read on the
device: the request's last sampled token from the target's next-input buffer, accepted drafts from the buffer
of the drafts proposed last.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.execution.overlap import to_device
from treadle.core.execution.sampler import SamplingBatch, argmax_last_dim, exponential_noise, filtered_probs
from treadle.core.hookspecs import Register, hookimpl
from treadle.core.speculative.speculator import Drafts, Speculator
from treadle.plugins.speculators.catch_up import CatchUp, index_tensor
from treadle.plugins.speculators.draft_memory import DraftMemory, DraftSequence, draft_kv_tokens, draft_server_config
from treadle.plugins.speculators.draft_tree import DraftTrees, TreeLevel

if TYPE_CHECKING:
    from treadle.core.execution.overlap import LaunchedStep
    from treadle.core.execution.worker import ModelWorker, WorkerInfo
    from treadle.core.registry import Registry
    from treadle.core.request import Req
    from treadle.core.resolved_config import ResolvedConfig
    from treadle.core.scheduling.schedule_batch import BatchEntry, ScheduleBatch

logger = logging.getLogger(__name__)


class DraftModelSpeculator(Speculator):
    """Drafts with a small model's :class:`ModelWorker` (``draft``) for the target worker ``target``."""

    def __init__(self, target: "ModelWorker", draft: "ModelWorker", num_draft_tokens: int, topk: int = 1,
                 max_requests: int = 1) -> None:
        check_same_vocabulary(target.info, draft.info)
        # Draft trees (topk > 1) for verify batches of up to max_requests requests; None: chains.
        self.trees = DraftTrees.for_worker(draft, topk, num_draft_tokens, max_requests) if topk > 1 else None
        self._tree_step: "LaunchedStep | None" = None  # the last tree verify step, its kept path not copied yet
        self.target = target
        self.draft = draft
        self.num_draft_tokens = num_draft_tokens
        self.memory = DraftMemory(draft.info)
        self.device = draft.info.device
        self.vocab_size = target.info.vocab_size
        # The drafts proposed last for each draft request-table row (accepted ones are read back from here).
        self.last_drafts = torch.zeros(draft.info.req_to_token_pool.size, max(num_draft_tokens, 1),
                                       dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------ Speculator

    def propose(self, batch: "ScheduleBatch", num_drafts: int) -> Drafts:
        entries = batch.entries
        bs = len(entries)
        token_ids = torch.zeros(bs, num_drafts, dtype=torch.int64, device=self.device)
        if num_drafts < 1:
            return Drafts(token_ids)
        reqs = [entry.req for entry in entries]
        last = [entry.kv_start for entry in entries]
        seqs = [self.memory.sequence(req) for req in reqs]
        for seq, position in zip(seqs, last):
            if seq is not None:
                seq.settle(position)
        self._copy_kept_paths()
        ahead = num_drafts if self.trees is None else 1  # a tree's nodes write their K/V to scratch slots
        ok = self.memory.reserve(seqs, [position + ahead for position in last])
        inputs = CatchUp()
        for i, (req, position, seq) in enumerate(zip(reqs, last, seqs)):
            if ok[i] and seq is not None:
                start = min(seq.seen, position)
                if not inputs.add(i, req, start, position, seq.slots[start:position + 1], seq):
                    seq.seen = 0  # a token it cannot read: it sits this step out and starts over next time
        if not inputs.rows:
            return Drafts(token_ids)
        live = [seqs[i] for i in inputs.rows]
        sampling = sampling_of([reqs[i] for i in inputs.rows], [last[i] for i in inputs.rows], self.vocab_size,
                               self.device)
        if self.trees is not None:
            return self._propose_trees(inputs, seqs, last, num_drafts, token_ids)
        drafts, probs = self._run(inputs, live, [last[i] for i in inputs.rows], num_drafts, sampling)
        for i in inputs.rows:
            seq = seqs[i]
            seq.seen, seq.proposed_at, seq.proposed, seq.drafts_at = last[i] + num_drafts, last[i], num_drafts, last[i]
        rows = to_device(torch.tensor([seq.row for seq in live], dtype=torch.int64), self.device)
        self.last_drafts[:, :num_drafts].index_copy_(0, rows, drafts)
        if len(inputs.rows) == bs:
            return Drafts(drafts, probs)
        index = to_device(torch.tensor(inputs.rows, dtype=torch.int64), self.device)
        token_ids.index_copy_(0, index, drafts)
        full_probs = None
        if probs is not None:  # requests that sat out propose token 0 "for sure": rejection handles it
            full_probs = torch.zeros(bs, num_drafts, self.vocab_size, dtype=torch.float32, device=self.device)
            full_probs[:, :, 0] = 1.0
            full_probs.index_copy_(0, index, probs)
        return Drafts(token_ids, full_probs)

    def _propose_trees(self, inputs: CatchUp, seqs: list[DraftSequence | None], last: list[int], num_drafts: int,
                       token_ids: torch.Tensor) -> Drafts:
        """Draft trees (plugins/speculators/draft_tree.py) for the rows of ``inputs``; the rows that sit out propose
        a chain of token 0. A tree's drafts are proposals without distributions (core/speculative/tree.py)."""
        live = [seqs[i] for i in inputs.rows]
        live_last = [last[i] for i in inputs.rows]
        input_ids = inputs.device_input_ids(self.device, self.target.next_input_ids.ids, self.last_drafts)
        root_logits = self.draft.forward(self._extend_batch(inputs, live, input_ids))
        drafts, parents = self.trees.grow(root_logits, [seq.row for seq in live], live_last, num_drafts,
                                          self.vocab_size, self._tree_level)
        for i in inputs.rows:
            seq = seqs[i]
            # Only the last token's K/V sits in the request's own row; the kept drafts are caught up on next time,
            # read from the buffer of last drafts once the verify step has laid its kept path there.
            seq.seen, seq.proposed_at, seq.proposed, seq.drafts_at = last[i] + 1, -1, num_drafts, last[i]
        bs = token_ids.shape[0]
        all_parents = torch.arange(-1, num_drafts - 1, device=self.device).expand(bs, num_drafts).clone()
        if len(inputs.rows) == bs:
            return Drafts(drafts, parents=parents)
        index = to_device(torch.tensor(inputs.rows, dtype=torch.int64), self.device)
        token_ids.index_copy_(0, index, drafts)
        all_parents.index_copy_(0, index, parents)
        return Drafts(token_ids, parents=all_parents)

    def _copy_kept_paths(self) -> None:
        """Lay the last tree verify step's kept drafts in the buffer of last drafts (device to device), where the
        catch-up reads the ones the host has not appended yet."""
        step, self._tree_step = self._tree_step, None
        if step is None or step.kept_ids is None:
            return
        pairs = [(i, seq.row) for i, entry in enumerate(step.batch.entries)
                 if (seq := self.memory.sequences.get(entry.req.rid)) is not None]
        if not pairs:
            return
        width = min(step.kept_ids.shape[1] - 1, self.last_drafts.shape[1])
        entries, rows = (index_tensor(values, self.device) for values in zip(*pairs))
        self.last_drafts[:, :width].index_copy_(0, rows, step.kept_ids.index_select(0, entries)[:, :width])

    def after_target_forward(self, step: "LaunchedStep") -> None:
        """A step of the target other than the verify step of a proposal settles that proposal (a plain decode
        step may follow a verify step); a prefill chunk is prefilled in the draft too, so that the first verify
        step of a request has only its last token to catch up on."""
        if getattr(step, "tree", None) is not None:
            self._tree_step = step
        prefills = []
        for entry in step.batch.entries:
            seq = self.memory.sequences.get(entry.req.rid)
            if seq is not None:
                seq.settle(entry.kv_start)
            if entry.extend_len > 1 and not step.forward_batch.forward_mode.is_verify():
                prefills.append(entry)
        if prefills:
            self._prefill(prefills)

    def _prefill(self, entries: list["BatchEntry"]) -> None:
        """The draft's forward over the prompt tokens of the target's prefill chunks (all on the host)."""
        self._copy_kept_paths()
        seqs = [self.memory.sequence(entry.req) for entry in entries]
        ends = [entry.kv_start + entry.extend_len for entry in entries]
        ok = self.memory.reserve(seqs, ends)
        inputs = CatchUp()
        for i, (entry, seq, end) in enumerate(zip(entries, seqs, ends)):
            if ok[i] and seq is not None:
                start = min(seq.seen, end - 1)
                if inputs.add(i, entry.req, start, end - 1, seq.slots[start:end], seq):
                    seq.seen = end
        if inputs.rows:
            live = [seqs[i] for i in inputs.rows]
            input_ids = inputs.device_input_ids(self.device, self.target.next_input_ids.ids, self.last_drafts)
            self.draft.forward(self._extend_batch(inputs, live, input_ids))

    def request_released(self, req: "Req") -> None:
        self.memory.release(req)

    def release_graphs(self) -> None:
        self.draft.release_graphs()

    # ------------------------------------------------------------------ draft steps

    def _run(self, inputs: CatchUp, seqs: list[DraftSequence], last: list[int], num_drafts: int,
             sampling: SamplingBatch | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Queue the catch-up extend and ``num_drafts - 1`` decode steps: the drafts ``[m, n]`` and, for a batch
        that samples, their distributions ``[m, n, vocab]``."""
        input_ids = inputs.device_input_ids(self.device, self.target.next_input_ids.ids, self.last_drafts)
        logits = self.draft.forward(self._extend_batch(inputs, seqs, input_ids))
        token, probs = self._pick(logits, sampling, 0)
        tokens, dists = [token], [probs]
        m = len(seqs)
        rows = to_device(torch.tensor([seq.row for seq in seqs], dtype=torch.int64), self.device)
        if num_drafts > 1:
            steps = torch.arange(1, num_drafts, dtype=torch.int64)
            # Step-major [n - 1, m]: each decode step reads one contiguous row.
            positions = (torch.tensor(last, dtype=torch.int64)[None, :] + steps[:, None]).contiguous()
            slots = torch.tensor([seq.slots[p + 1:p + num_drafts] for seq, p in zip(seqs, last)],
                                 dtype=torch.int64).t().contiguous()
            positions_dev, slots_dev = to_device(positions, self.device), to_device(slots, self.device)
            logits_rows = to_device(torch.arange(m, dtype=torch.int64), self.device)
            for j in range(num_drafts - 1):
                logits = self.draft.forward(self._decode_batch(rows, token, positions_dev[j], positions[j] + 1,
                                                               slots_dev[j], logits_rows))
                token, probs = self._pick(logits, sampling, j + 1)
                tokens.append(token)
                dists.append(probs)
        drafts = torch.stack(tokens, dim=1)
        return drafts, (torch.stack(dists, dim=1) if sampling is not None else None)

    def _pick(self, logits: torch.Tensor, sampling: SamplingBatch | None, step: int) -> tuple[torch.Tensor, Any]:
        logits = logits[:, :self.vocab_size]
        if sampling is None:
            return argmax_last_dim(logits), None
        probs = draft_distribution(logits.float(), sampling, self.vocab_size)
        return (probs / draft_noise(sampling, step, probs.shape[-1])).argmax(dim=-1), probs

    def _extend_batch(self, inputs: CatchUp, seqs: list[DraftSequence], input_ids: torch.Tensor) -> ForwardBatch:
        runner, device = self.draft.runner, self.device
        lens = torch.tensor(inputs.extend_lens, dtype=torch.int64)
        prefix = torch.tensor(inputs.prefix_lens, dtype=torch.int64)
        seq_lens = prefix + lens
        starts = torch.cumsum(lens, 0) - lens
        return ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND, batch_size=len(seqs), input_ids=input_ids,
            positions=to_device(torch.tensor(inputs.positions, dtype=torch.int64), device),
            req_pool_indices=to_device(torch.tensor([seq.row for seq in seqs], dtype=torch.int64), device),
            seq_lens=to_device(seq_lens, device), seq_lens_cpu=seq_lens,
            out_cache_loc=to_device(torch.tensor(inputs.slots, dtype=torch.int64), device),
            seq_lens_sum=int(seq_lens.sum()), logits_indices=to_device(starts + lens - 1, device),
            req_to_token_pool=runner.req_to_token_pool, kv_cache=runner.kv_cache, attn_backend=runner.attn_backend,
            extend_seq_lens=to_device(lens, device), extend_prefix_lens=to_device(prefix, device),
            extend_start_loc=to_device(starts, device), extend_seq_lens_cpu=inputs.extend_lens,
            extend_prefix_lens_cpu=inputs.prefix_lens,
        )

    def _tree_level(self, level: TreeLevel) -> torch.Tensor:
        """One decode step of a draft tree's frontier (plugins/speculators/draft_tree.py): its logits."""
        rows = level.rows.shape[0]
        return self.draft.forward(self._decode_batch(level.rows, level.tokens, level.positions, level.seq_lens,
                                                     level.slots, torch.arange(rows, device=self.device)))

    def _decode_batch(self, rows: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                      seq_lens: torch.Tensor, slots: torch.Tensor, logits_rows: torch.Tensor) -> ForwardBatch:
        runner = self.draft.runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=int(rows.shape[0]), input_ids=input_ids,
            positions=positions, req_pool_indices=rows, seq_lens=to_device(seq_lens, self.device),
            seq_lens_cpu=seq_lens, out_cache_loc=slots, seq_lens_sum=int(seq_lens.sum()),
            logits_indices=logits_rows, req_to_token_pool=runner.req_to_token_pool, kv_cache=runner.kv_cache,
            attn_backend=runner.attn_backend,
        )


def sampling_of(reqs: list["Req"], last: list[int], vocab_size: int, device: torch.device) -> SamplingBatch | None:
    """The batch's sampling parameters, or None when every request is greedy (the drafts are argmaxes). ``steps``
    counts from each request's output position at its last token (``last``), which the host knows exactly (its
    ``output_ids`` may lag under overlap scheduling)."""
    if all(req.sampling_params.is_greedy for req in reqs):
        return None
    sampling = SamplingBatch.from_reqs(reqs, vocab_size, device)
    sampling.steps = index_tensor([p - len(req.origin_input_ids) for req, p in zip(reqs, last)], device)
    return sampling


# Salts a request's seed for its drafts' noise, so that they do not reuse the noise the target samples with.
DRAFT_SEED_SALT = 0x5BD1E995


def draft_noise(sampling: SamplingBatch, step: int, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise ``[rows, vocab]`` for sampling the ``step``-th draft of each request: a function of the request's
    seed and output position only, so a seeded request drafts (and so keeps) the same tokens in every run."""
    return exponential_noise(sampling.seeds ^ DRAFT_SEED_SALT, sampling.steps + step, vocab_size)


def draft_distribution(logits: torch.Tensor, sampling: SamplingBatch, vocab_size: int) -> torch.Tensor:
    """Each row's distribution ``[rows, vocab]`` under its request's temperature, top-k, top-p and min-p (a greedy
    request's: one-hot on its argmax), through the target's sampler's transforms (``filtered_probs``)."""
    probs = filtered_probs(logits, sampling)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    probs = torch.where(sampling.greedy.unsqueeze(1), one_hot, probs)
    if probs.shape[1] < vocab_size:  # a draft vocabulary smaller than the target's
        probs = torch.nn.functional.pad(probs, (0, vocab_size - probs.shape[1]))
    return probs


def check_same_vocabulary(target: "WorkerInfo", draft: "WorkerInfo") -> None:
    """Refuse a draft whose token ids do not mean the target's: a larger vocabulary, or other special tokens."""
    problems = []
    if draft.vocab_size > target.vocab_size:
        problems.append(f"its vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}")
    for key in ("bos_token_id", "eos_token_id"):
        mine, theirs = getattr(draft.hf_config, key, None), getattr(target.hf_config, key, None)
        if mine is not None and theirs is not None and mine != theirs:
            problems.append(f"its {key} is {mine}, the target's {theirs}")
    if problems:
        raise ValueError(
            f"speculative.draft_model_path {draft.model_dir} does not share the target's tokenizer "
            f"({'; '.join(problems)}); pick a draft model of the same tokenizer as {target.model_dir}")


def build_draft_speculator(target: "ModelWorker", config: "ResolvedConfig", registry: "Registry") -> Speculator:
    """The ``draft`` factory: loads ``speculative.draft_model_path`` beside the target."""
    from treadle.core.execution.worker import ModelWorker

    spec = config.speculative
    if not spec.draft_model_path:
        raise ValueError("speculative.method 'draft' needs speculative.draft_model_path (a model folder or "
                         ".gguf file of the target's tokenizer)")
    kv_tokens = draft_kv_tokens(target.info, spec.num_tokens, spec.draft_model_path, config.cache.mem_fraction)
    spare_rows = 0
    if spec.topk > 1:  # a draft tree's scratch rows and slots (plugins/speculators/draft_tree.py)
        spare_rows = int(spec.max_batch_size) * spec.topk
        kv_tokens += spare_rows * max(1, spec.num_tokens - spec.topk)
    draft_config = draft_server_config(config, target.info, spec.draft_model_path, kv_tokens, spare_rows)
    try:
        draft = ModelWorker(draft_config, registry)
    except torch.cuda.OutOfMemoryError as exc:
        raise RuntimeError(
            f"no GPU memory left for the draft model {spec.draft_model_path} and its KV pool of {kv_tokens} "
            f"tokens after the target's: lower cache.mem_fraction (now {config.cache.mem_fraction}) to leave room "
            "for them (docs/speculative.md)") from exc
    logger.info("draft model %s: KV pool of %d tokens", draft.info.model_dir, draft.info.max_total_tokens)
    return DraftModelSpeculator(target, draft, spec.num_tokens, spec.topk, int(spec.max_batch_size))


@hookimpl
def treadle_register_speculators(register: Register) -> None:
    register("draft", build_draft_speculator)
