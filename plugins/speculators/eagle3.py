"""The ``eagle3`` speculator: EAGLE-3 draft heads (eagle3_model.py) reading the target's low/mid/high hidden states.

The target records the inputs of three of its layers in every forward (a ``HiddenStateTap``, its CUDA graphs
captured again with it); after each target forward the head turns them into features (``fc``). The head's KV has
one layer and is indexed by the target's own KV slots and request table: the pair at position ``q`` (the feature
of ``q``, the token at ``q + 1``) is stored at the slot of the target's position ``q``. A request's prefix found in
the radix cache therefore brings the head's KV with it, and there is nothing per request to allocate or free.

A pair can be computed once the token after its position is known. After a prefill chunk or a plain decode step
the head computes every pair whose next token is on the host (one extend step, no logits) and keeps the last
feature pending; after a verify step it keeps all ``t`` features pending, since which drafts were kept is only
known at the next step. :meth:`Eagle3Speculator.propose` computes the pending pairs up to the request's last
sampled token in one extend step, whose last row gives the first draft, then runs ``n - 1`` decode steps that
feed the head its own output hidden state. Drafts are greedy, or sampled (with ``Drafts.probs``) for requests
that sample; draft-vocabulary ids become target ids through ``d2t``.

An overlapped verify batch (``speculative.overlap``, chains) is queued before the host reads the verify step it
follows: :meth:`Eagle3Speculator.propose_on_device` runs the catch-up and the drafts from the device's accepted
counts (eagle3_overlap.py), and the host's view of the request (``HeadState.anchor``) is its batch entry, whose
``kv_start`` is exact once that step is read.

With ``speculative.topk`` > 1 the head grows draft trees instead (eagle3_tree.py) from its output at the last
sampled token. The verify step's features wait in node order; once its kept path is known (its sampling queued),
they are laid in depth order and its kept drafts in the buffer of last drafts, as a chain's would be.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from treadle.core.execution.attention import AttentionBackend, build_attention_backend, joins_overlapped_verify
from treadle.core.execution.attention_context import AttentionContext
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.execution.overlap import to_device
from treadle.core.execution.sampler import SamplingBatch, argmax_last_dim
from treadle.core.hookspecs import Register, hookimpl
from treadle.core.memory.pools import KVCache
from treadle.core.speculative.speculator import Drafts, Speculator
from treadle.layers.decoder import HiddenStateTap
from treadle.plugins.speculators.catch_up import CatchUp, index_tensor
from treadle.plugins.speculators.draft import draft_distribution, draft_noise, sampling_of
from treadle.plugins.speculators.eagle3_graphs import HeadDecodeGraphs
from treadle.plugins.speculators.eagle3_model import Eagle3Head, aux_layer_ids, load_eagle3_head
from treadle.plugins.speculators.eagle3_overlap import propose_chains_on_device
from treadle.plugins.speculators.eagle3_tree import HeadTrees, tree_scratch_slots

if TYPE_CHECKING:
    from treadle.core.execution.overlap import LaunchedStep
    from treadle.core.execution.worker import ModelWorker
    from treadle.core.registry import Registry
    from treadle.core.request import Req
    from treadle.core.resolved_config import ResolvedConfig
    from treadle.core.scheduling.schedule_batch import BatchEntry, ScheduleBatch

logger = logging.getLogger(__name__)


@dataclass
class HeadState:
    """One request as the head knows it: pairs ``[0, seen)`` are in its KV; the features of positions
    ``[pending_at, pending_at + pending)`` wait in row ``row`` of the pending buffer; the last proposal's drafts
    (``proposed`` of them, after ``drafts_at``) in the same row of the last-drafts buffer.

    After an overlapped verify step (drafted on the device) all three positions are its entry's ``kv_start``
    (``anchor``), which is only an upper bound until the step before it is read: :meth:`settle` takes it then."""

    row: int
    seen: int = 0
    pending_at: int = -1
    pending: int = 0
    drafts_at: int = -1
    proposed: int = 0
    anchor: "BatchEntry | None" = None

    def settle(self) -> "HeadState":
        """Take the position of the overlapped verify entry it waits on (``anchor``: exact once the step before that
        one is read); returns ``self``."""
        if self.anchor is not None:
            self.seen = self.pending_at = self.drafts_at = self.anchor.kv_start
            self.anchor = None
        return self

    def pending_covers(self, first: int, last: int) -> bool:
        return self.pending_at >= 0 and self.pending_at <= first and last < self.pending_at + self.pending


class Eagle3Speculator(Speculator):
    """Drafts with an EAGLE-3 head over the hidden states of the target worker ``target`` (module docstring)."""

    def __init__(self, target: "ModelWorker", head: Eagle3Head, num_draft_tokens: int, registry: "Registry",
                 topk: int = 1, max_requests: int = 1) -> None:
        runner = target.runner
        self.target, self.head, self.num_draft_tokens = target, head, num_draft_tokens
        self.device, self.vocab_size = target.info.device, target.info.vocab_size
        embedding = getattr(getattr(runner.model, "model", None), "embed_tokens", None)
        capture = runner.model_traits.capture_hidden_states
        if capture is None or embedding is None:
            raise ValueError(f"speculative.method 'eagle3' needs a target that records its layers' hidden states "
                             f"(capture_hidden_states); {type(runner.model).__name__} does not")
        head.use_target_embedding(embedding)
        config = target.config
        hidden = runner.hf_config.hidden_size
        graph_rows = config.runtime.cuda_graph_max_bs * (num_draft_tokens + 1)
        self.tap = HiddenStateTap(aux_layer_ids(head.config, runner.num_layers), hidden,
                                  max(graph_rows, config.runtime.piecewise_cuda_graph_max_tokens), runner.dtype,
                                  self.device)
        capture(self.tap)
        target.capture_graphs()  # again, now recording the hidden states
        # Draft trees' frontier nodes write their pairs to scratch slots past the target's (eagle3_tree.py).
        scratch = tree_scratch_slots(topk, num_draft_tokens, max_requests) if topk > 1 else 0
        scratch = -(-scratch // target.info.page_size) * target.info.page_size  # whole pages, for paged views
        self.kv_cache = KVCache(target.info.max_total_tokens + scratch, target.info.page_size, 1,
                                head.midlayer.self_attn.num_kv_heads, head.midlayer.self_attn.head_dim,
                                runner.kv_dtype, self.device)
        self.attn_backend, backend_name = build_attention_backend(registry, config.attention.backend,
                                                                  self._context(target))
        rows = target.info.req_to_token_pool.size
        self.pending = torch.zeros(rows, num_draft_tokens + 1, head.config.hidden_size, dtype=runner.dtype,
                                   device=self.device)
        self.last_drafts = torch.zeros(rows, num_draft_tokens, dtype=torch.int64, device=self.device)
        self.draft_to_target = head.to_target_ids(torch.arange(head.draft_vocab_size, device=self.device))
        self._arange = torch.arange(max(rows, (num_draft_tokens + 1) * config.runtime.cuda_graph_max_bs),
                                    device=self.device)
        # Overlapped verify batches (chains): drafted on the device, their catch-up captured as verify graphs.
        self.proposes_on_device = topk == 1 and reads_device_lengths(self.attn_backend, self.device)
        catch_up_graphs = self.proposes_on_device and config.speculative.overlap is not False and \
            not config.scheduler.disable_overlap and getattr(self.attn_backend, "supports_verify_cuda_graph", False)
        self.states: dict[str, HeadState] = {}
        self.catch_up_layouts: dict[tuple[int, int], list[torch.Tensor]] = {}  # (bs, t) -> eagle3_overlap.py's
        self.graphs: HeadDecodeGraphs | None = None
        if target.cuda_graphs is not None and getattr(self.attn_backend, "supports_cuda_graph", False):
            max_bs = min(config.runtime.cuda_graph_max_bs, config.speculative.max_batch_size)
            self.graphs = HeadDecodeGraphs(head, self.attn_backend, self._context(target), max_bs,
                                           catch_up_tokens=range(2, num_draft_tokens + 2) if catch_up_graphs else ())
        self.trees: HeadTrees | None = None
        if topk > 1:
            self.trees = HeadTrees(head, self.kv_cache, self._context(target), backend_name, registry,
                                   target.info.req_to_token_pool.req_to_token,
                                   target.info.max_total_tokens + target.info.page_size, topk, num_draft_tokens,
                                   max_requests, graphs=self.graphs is not None)
        self._tree_step: "LaunchedStep | None" = None  # the last tree verify step, its features not laid out yet

    def _context(self, target: "ModelWorker") -> AttentionContext:
        attn = self.head.midlayer.self_attn
        return AttentionContext(
            device=self.device, dtype=target.info.dtype, kv_dtype=self.kv_cache.dtype, num_layers=1,
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            page_size=target.info.page_size, context_len=target.info.context_len,
            req_to_token_pool=target.info.req_to_token_pool, kv_cache=self.kv_cache)

    # ------------------------------------------------------------------ Speculator

    @torch.inference_mode()
    def propose(self, batch: "ScheduleBatch", num_drafts: int) -> Drafts:
        entries = batch.entries
        token_ids = torch.zeros(len(entries), num_drafts, dtype=torch.int64, device=self.device)
        if num_drafts < 1:
            return Drafts(token_ids)
        self._lay_kept_paths()
        batch.write_req_to_token(self.target.info.req_to_token_pool.req_to_token)  # the drafts' slots
        inputs, feature_rows = CatchUp(), []
        for i, entry in enumerate(entries):
            req, last = entry.req, entry.kv_start
            state = self.states.get(req.rid)
            if state is None or last < 1:
                continue
            state.settle()
            first = min(state.seen, last - 1)
            if state.pending_covers(first, last - 1) and inputs.add(
                    i, req, first + 1, last, req.kv_slots[first:last].tolist(), state, shift=1):
                feature_rows.extend(self._pending_row(state, q) for q in range(first, last))
        if not inputs.rows:
            return Drafts(token_ids)
        live = [entries[i] for i in inputs.rows]
        if self.trees is not None:
            return self._propose_trees(inputs, feature_rows, live, num_drafts, token_ids)
        sampling = sampling_of([e.req for e in live], [e.kv_start for e in live], self.vocab_size, self.device)
        drafts, probs = self._draft(inputs, feature_rows, live, num_drafts, sampling)
        self._proposed(live, num_drafts)
        rows = index_tensor([e.req.req_pool_idx for e in live], self.device)
        self.last_drafts[:, :num_drafts].index_copy_(0, rows, drafts)
        if len(live) == len(entries):
            return Drafts(drafts, probs)
        index = index_tensor(inputs.rows, self.device)
        token_ids.index_copy_(0, index, drafts)
        full_probs = None
        if probs is not None:  # requests that sat out propose token 0 "for sure": rejection handles it
            full_probs = torch.zeros(len(entries), num_drafts, self.vocab_size, device=self.device)
            full_probs[:, :, 0] = 1.0
            full_probs.index_copy_(0, index, probs)
        return Drafts(token_ids, full_probs)

    @torch.inference_mode()
    def propose_on_device(self, batch: "ScheduleBatch", num_drafts: int, positions: torch.Tensor,
                          req_pool_indices: torch.Tensor) -> Drafts:
        drafts = propose_chains_on_device(self, batch, num_drafts, positions, req_pool_indices)
        self.last_drafts[:, :num_drafts].index_copy_(0, req_pool_indices, drafts)
        for entry in batch.entries:
            state = self._state(entry.req)
            state.anchor, state.proposed = entry, num_drafts
        return Drafts(drafts)

    def run_head(self, batch: ForwardBatch, features: torch.Tensor,
                 rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the head over ``batch`` (a decode or chain-verify batch; graphs where captured): its output
        hidden states and logits, of ``rows`` only when given."""
        graphs = self.graphs
        if graphs is not None and graphs.can_run(batch):
            logits, hidden = graphs.replay(batch, features)
            if rows is not None:
                logits, hidden = logits.index_select(0, rows), hidden.index_select(0, rows)
            return hidden, logits
        self.attn_backend.init_forward_metadata(batch)
        hidden = self.head(batch.input_ids, batch.positions, features, batch)
        if rows is not None:
            hidden = hidden.index_select(0, rows)
        return hidden, self.head.logits(hidden)

    def rows_arange(self, n: int) -> torch.Tensor:
        """``0 .. n - 1`` on the device (a decode step's logits rows), without an allocation."""
        return self._arange[:n]

    def _propose_trees(self, inputs: CatchUp, feature_rows: list[int], live: list["BatchEntry"], num_drafts: int,
                       token_ids: torch.Tensor) -> Drafts:
        """Draft trees (eagle3_tree.py) for the requests of ``inputs``; the others propose a chain of token 0."""
        root = self._root_hidden(inputs, feature_rows)
        drafts, parents = self.trees.grow(root, [e.req.req_pool_idx for e in live], [e.kv_start - 1 for e in live],
                                          num_drafts, self.draft_to_target)
        self._proposed(live, num_drafts)
        bs = token_ids.shape[0]
        if len(live) == bs:
            return Drafts(drafts, parents=parents)
        all_parents = torch.arange(-1, num_drafts - 1, device=self.device).expand(bs, num_drafts).clone()
        index = index_tensor(inputs.rows, self.device)
        token_ids.index_copy_(0, index, drafts)
        all_parents.index_copy_(0, index, parents)
        return Drafts(token_ids, parents=all_parents)

    def _proposed(self, live: list["BatchEntry"], num_drafts: int) -> None:
        for entry in live:
            state = self.states[entry.req.rid]
            state.seen, state.drafts_at, state.proposed = entry.kv_start, entry.kv_start, num_drafts

    def _lay_kept_paths(self) -> None:
        """The last tree verify step's features in depth order along its kept path, and its kept drafts in the
        buffer of last drafts (device to device; its sampling is queued by now)."""
        step, self._tree_step = self._tree_step, None
        if step is None or step.kept_path is None:
            return
        rows, path = step.forward_batch.req_pool_indices, step.kept_path
        bs, t = path.shape
        kept = self.pending.index_select(0, rows)[:, :t].gather(
            1, path.unsqueeze(2).expand(bs, t, self.pending.shape[-1]))
        self.pending[:, :t].index_copy_(0, rows, kept)
        width = min(t - 1, self.last_drafts.shape[1])
        self.last_drafts[:, :width].index_copy_(0, rows, step.kept_ids[:, :width])

    @torch.inference_mode()
    def after_target_forward(self, step: "LaunchedStep") -> None:
        forward_batch = step.forward_batch
        entries = step.batch.entries
        self._lay_kept_paths()
        if step.tree is not None:
            self._tree_step = step
        if not entries:
            return
        features = self.head.features(self.tap.output(forward_batch.num_tokens))
        if forward_batch.forward_mode.is_verify():  # every position's feature waits for the verdict
            t = forward_batch.tokens_per_req
            self.pending[:, :t].index_copy_(0, forward_batch.req_pool_indices,
                                            features.view(len(entries), t, -1).to(self.pending.dtype))
            overlapped = step.batch.follows is not None
            for entry in entries:
                state = self._state(entry.req)
                if overlapped:  # its positions are known once the step before is read (HeadState.settle)
                    state.anchor, state.pending = entry, t
                    continue
                state.pending_at, state.pending, state.seen = entry.kv_start, t, max(state.seen, entry.kv_start)
            return
        self._flush(entries, features)

    def request_released(self, req: "Req") -> None:
        self.states.pop(req.rid, None)

    def release_graphs(self) -> None:
        if self.trees is not None:
            self.trees.release_graphs()
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    # ------------------------------------------------------------------ steps of the head

    def _flush(self, entries: list["BatchEntry"], features: torch.Tensor) -> None:
        """After a prefill chunk or a plain decode step: compute every pair whose next token is on the host (or is
        the step's input), keep the rest pending."""
        inputs, sources, keep = CatchUp(), [], []
        start_row = 0
        for i, entry in enumerate(entries):
            req, state = entry.req, self._state(entry.req)
            start, end = entry.kv_start, entry.kv_start + entry.extend_len
            first = state.seen if state.seen < start and state.pending_covers(state.seen, start - 1) else start
            last = end - 1 if end < req.seq_len else end - 2  # the last pair whose next token is known
            if first <= last:
                slots = req.kv_slots[first:min(start, last + 1)].tolist()
                if last >= start:
                    slots += entry.new_slots[max(first - start, 0):last + 1 - start].tolist()
                if inputs.add(i, req, first + 1, last + 1, slots, state, shift=1):
                    sources.extend(self._pending_row(state, q) if q < start else -(start_row + q - start) - 1
                                   for q in range(first, last + 1))
            state.seen = max(state.seen, last + 1)
            if last + 1 < end:  # the step's last position: its next token is what this step samples
                keep.append((state.row, start_row + end - 1 - start))
                state.pending_at, state.pending = end - 1, 1
            start_row += entry.extend_len
        if inputs.rows:
            rows = self._gather_features(sources, features)
            self._catch_up(inputs, rows)
        if keep:
            rows, at = zip(*keep)
            self.pending[:, 0].index_copy_(0, index_tensor(rows, self.device),
                                           features.index_select(0, index_tensor(at, self.device))
                                           .to(self.pending.dtype))

    def _draft(self, inputs: CatchUp, feature_rows: list[int], live: list["BatchEntry"], num_drafts: int,
               sampling: SamplingBatch | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self._root_hidden(inputs, feature_rows)
        token, probs = self._pick(self.head.logits(hidden), sampling, 0)
        tokens, dists = [token], [probs]
        m = len(live)
        rows = index_tensor([e.req.req_pool_idx for e in live], self.device)
        for j in range(1, num_drafts):
            positions = torch.tensor([e.kv_start + j - 1 for e in live], dtype=torch.int64)
            slots = torch.tensor([int(e.new_slots[j - 1]) for e in live], dtype=torch.int64)
            batch = self._decode_batch(rows, token, positions, slots, m)
            if self.graphs is not None and self.graphs.can_run(batch):
                logits, hidden = self.graphs.replay(batch, hidden)
            else:
                self.attn_backend.init_forward_metadata(batch)
                hidden = self.head(token, batch.positions, hidden, batch)
                logits = self.head.logits(hidden)
            token, probs = self._pick(logits, sampling, j)
            tokens.append(token)
            dists.append(probs)
        return torch.stack(tokens, dim=1), (torch.stack(dists, dim=1) if sampling is not None else None)

    def _root_hidden(self, inputs: CatchUp, feature_rows: list[int]) -> torch.Tensor:
        """The catch-up over the pending pairs; the head's output hidden state at each request's last pair."""
        features = self.pending.view(-1, self.pending.shape[-1]).index_select(0, index_tensor(feature_rows,
                                                                                              self.device))
        hidden = self._catch_up(inputs, features)
        last_rows = index_tensor(torch.tensor(inputs.extend_lens).cumsum(0).sub(1).tolist(), self.device)
        return hidden.index_select(0, last_rows)

    def _pick(self, logits: torch.Tensor, sampling: SamplingBatch | None, step: int) -> tuple[torch.Tensor, Any]:
        """Target ids of the next drafts from the head's logits (and their distributions over the target's
        vocabulary when the batch samples)."""
        if sampling is None:
            return self.draft_to_target[argmax_last_dim(logits)], None
        probs = draft_distribution(logits.float(), sampling, logits.shape[-1])
        picked = (probs / draft_noise(sampling, step, probs.shape[-1])).argmax(dim=-1)
        target_probs = torch.zeros(probs.shape[0], self.vocab_size, device=self.device)
        target_probs.index_copy_(1, self.draft_to_target, probs)
        return self.draft_to_target[picked], target_probs

    def _catch_up(self, inputs: CatchUp, features: torch.Tensor) -> torch.Tensor:
        """The head's extend step over ``inputs``' pairs: each pair's output hidden state."""
        input_ids = inputs.device_input_ids(self.device, self.target.next_input_ids.ids, self.last_drafts)
        batch = self._extend_batch(inputs, input_ids)
        return self.head(input_ids, batch.positions, features, batch)

    def _gather_features(self, sources: list[int], features: torch.Tensor) -> torch.Tensor:
        """Rows of the pending buffer (``>= 0``: flat index) and of this step's features (``-row - 1``)."""
        flat = self.pending.view(-1, self.pending.shape[-1])
        out = torch.empty(len(sources), flat.shape[-1], dtype=flat.dtype, device=self.device)
        old = [(k, s) for k, s in enumerate(sources) if s >= 0]
        new = [(k, -s - 1) for k, s in enumerate(sources) if s < 0]
        for picked, table in ((old, flat), (new, features.to(flat.dtype))):
            if picked:
                at, rows = zip(*picked)
                out.index_copy_(0, index_tensor(at, self.device), table.index_select(0, index_tensor(rows, self.device)))
        return out

    def _pending_row(self, state: HeadState, position: int) -> int:
        return state.row * self.pending.shape[1] + position - state.pending_at

    def _state(self, req: "Req") -> HeadState:
        state = self.states.get(req.rid)
        if state is None:
            state = self.states[req.rid] = HeadState(req.req_pool_idx)
        return state.settle()

    def _extend_batch(self, inputs: CatchUp, input_ids: torch.Tensor) -> ForwardBatch:
        device = self.device
        lens = torch.tensor(inputs.extend_lens, dtype=torch.int64)
        prefix = torch.tensor(inputs.prefix_lens, dtype=torch.int64)
        seq_lens = prefix + lens
        starts = torch.cumsum(lens, 0) - lens
        batch = ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND, batch_size=len(inputs.rows), input_ids=input_ids,
            positions=to_device(torch.tensor(inputs.positions, dtype=torch.int64), device),
            req_pool_indices=index_tensor(inputs.table_rows, device), seq_lens=to_device(seq_lens, device),
            seq_lens_cpu=seq_lens, out_cache_loc=to_device(torch.tensor(inputs.slots, dtype=torch.int64), device),
            seq_lens_sum=int(seq_lens.sum()), logits_indices=to_device(starts + lens - 1, device),
            req_to_token_pool=self.target.info.req_to_token_pool, kv_cache=self.kv_cache,
            attn_backend=self.attn_backend, extend_seq_lens=to_device(lens, device), extend_prefix_lens=to_device(prefix, device),
            extend_start_loc=to_device(starts, device), extend_seq_lens_cpu=inputs.extend_lens,
            extend_prefix_lens_cpu=inputs.prefix_lens,
        )
        self.attn_backend.init_forward_metadata(batch)
        return batch

    def _decode_batch(self, rows: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, m: int) -> ForwardBatch:
        seq_lens = positions + 1
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=m, input_ids=input_ids,
            positions=to_device(positions, self.device), req_pool_indices=rows,
            seq_lens=to_device(seq_lens, self.device), seq_lens_cpu=seq_lens,
            out_cache_loc=to_device(slots, self.device), seq_lens_sum=int(seq_lens.sum()),
            logits_indices=torch.arange(m, device=self.device), req_to_token_pool=self.target.info.req_to_token_pool,
            kv_cache=self.kv_cache, attn_backend=self.attn_backend,
        )


def reads_device_lengths(backend: AttentionBackend, device: torch.device) -> bool:
    """Whether the head's attention backend runs its decode and chain-verify steps from the lengths on the device
    (the host's are upper bounds under overlapped verify): on the CPU any backend (host and device are one), on CUDA
    one that joins overlapped verify (``AttentionBackend.verifies_by_decode``) and decodes from the device's lengths
    too (``AttentionBackend.decodes_by_device_lengths``)."""
    if device.type == "cpu":
        return True
    return joins_overlapped_verify(backend) and backend.decodes_by_device_lengths()


def build_eagle3_speculator(target: "ModelWorker", config: "ResolvedConfig", registry: "Registry") -> Speculator:
    """The ``eagle3`` factory: loads the head from ``speculative.draft_model_path`` beside the target."""
    spec = config.speculative
    if config.parallel.tp_size > 1:
        raise ValueError("speculative.method 'eagle3' runs at parallel.tp_size 1 for now (its head is not sharded); "
                         "use ngram or draft under tensor parallelism")
    head = load_eagle3_head(spec.draft_model_path, target.info.device, target.info.dtype)
    if head.embed_tokens is None and head.config.vocab_size != target.info.vocab_size:
        raise ValueError(f"the EAGLE-3 head {spec.draft_model_path} is for a vocabulary of {head.config.vocab_size} "
                         f"tokens, the target's has {target.info.vocab_size}: it belongs to another model")
    logger.info("EAGLE-3 head %s: draft vocabulary of %d tokens", spec.draft_model_path, head.draft_vocab_size)
    return Eagle3Speculator(target, head, spec.num_tokens, registry, spec.topk, int(spec.max_batch_size))


@hookimpl
def treadle_register_speculators(register: Register) -> None:
    register("eagle3", build_eagle3_speculator)
