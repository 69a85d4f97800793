"""Draft trees of the ``eagle3`` speculator (``speculative.topk`` > 1), grown as the ``draft`` speculator grows
them (plugins/speculators/draft_tree.py).

The head's tree steps read a request table of their own: ``topk`` scratch rows per request of the largest verify
batch, each holding the request's row of the target's table up to its last token, then the slots of the node's
ancestors. The frontier nodes write their pairs to scratch slots past the target's in the head's KV cache (which is
that much larger), viewed with page size 1 by an attention backend of their own (the head's backend, built again
over the scratch table), so neither the target's request table nor its KV pool lends anything. A frontier node
reads the output hidden state of its parent: the head's at the request's last token for the first level, then the
parent frontier node's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from treadle.core.execution.attention import build_attention_backend
from treadle.core.execution.attention_context import AttentionContext
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.execution.overlap import to_device
from treadle.core.memory.pools import KVCache, ReqToTokenPool
from treadle.plugins.speculators.draft_tree import DraftTrees, TreeLevel, scratch_depth
from treadle.plugins.speculators.eagle3_graphs import HeadDecodeGraphs

if TYPE_CHECKING:
    from treadle.core.registry import Registry
    from treadle.plugins.speculators.eagle3_model import Eagle3Head


def tree_scratch_slots(topk: int, num_draft_tokens: int, max_requests: int) -> int:
    """How many KV slots the head's cache holds past the target's for draft trees."""
    return max_requests * topk * scratch_depth(topk, num_draft_tokens)


class HeadTrees:
    """Grows EAGLE-3 draft trees of width ``topk`` for up to ``max_requests`` requests a step (module docstring).

    ``kv_cache``: the head's, with :func:`tree_scratch_slots` slots past ``first_scratch_slot``; ``context``: the
    head's attention context (its backend named ``backend_name``); ``graphs``: capture the tree steps' CUDA graphs."""

    def __init__(self, head: "Eagle3Head", kv_cache: KVCache, context: AttentionContext, backend_name: str,
                 registry: "Registry", source_table: torch.Tensor, first_scratch_slot: int, topk: int,
                 num_draft_tokens: int, max_requests: int, graphs: bool) -> None:
        self.head, self.kv_cache, self.device = head, kv_cache, context.device
        self.pool = ReqToTokenPool(max_requests * topk, context.context_len + 1, context.device)
        depth = scratch_depth(topk, num_draft_tokens)
        slots = torch.arange(tree_scratch_slots(topk, num_draft_tokens, max_requests), dtype=torch.int64)
        self.trees = DraftTrees(self.pool.req_to_token, torch.arange(max_requests * topk).view(max_requests, topk),
                                (slots + first_scratch_slot).view(max_requests, topk, depth), topk, num_draft_tokens,
                                context.device, source_table=source_table)
        self.context = AttentionContext(
            device=context.device, dtype=context.dtype, kv_dtype=context.kv_dtype, num_layers=1,
            num_heads=context.num_heads, num_kv_heads=context.num_kv_heads, head_dim=context.head_dim, page_size=1,
            context_len=context.context_len, req_to_token_pool=self.pool, kv_cache=kv_cache)
        self.attn_backend, _ = build_attention_backend(registry, backend_name, self.context)
        self.graphs: HeadDecodeGraphs | None = None
        if graphs and getattr(self.attn_backend, "supports_cuda_graph", False):
            self.graphs = HeadDecodeGraphs(head, self.attn_backend, self.context, max_requests * topk)
        self._width = topk
        self._hidden: torch.Tensor | None = None  # the output hidden states of the level fed last

    def grow(self, root_hidden: torch.Tensor, main_rows: list[int], last: list[int], num_drafts: int,
             draft_to_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_ids, parents)`` ``[m, num_drafts]`` (target ids) for ``m`` requests whose head output at their
        last sampled token is ``root_hidden`` ``[m, hidden]``; ``last[i]``: the position of the request's last pair
        in the head's KV (one before its last sampled token), in row ``main_rows[i]`` of the target's table."""
        self._width = min(self.trees.topk, num_drafts)
        self._hidden = root_hidden
        try:
            return self.trees.grow(self.head.logits(root_hidden), main_rows, last, num_drafts,
                                   self.head.draft_vocab_size, self._level, token_map=draft_to_target)
        finally:
            self._hidden = None

    def _level(self, level: TreeLevel) -> torch.Tensor:
        """One decode step of the head over a tree's frontier; its logits over the draft vocabulary."""
        k, hidden = self._width, self._hidden
        if level.parent_branch is None:
            features = hidden.repeat_interleave(k, dim=0)
        else:
            m = level.parent_branch.shape[0]
            columns = level.parent_branch.unsqueeze(2).expand(m, k, hidden.shape[-1])
            features = hidden.view(m, k, -1).gather(1, columns).flatten(0, 1)
        rows = level.rows.shape[0]
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=rows, input_ids=level.tokens, positions=level.positions,
            req_pool_indices=level.rows, seq_lens=to_device(level.seq_lens, self.device), seq_lens_cpu=level.seq_lens,
            out_cache_loc=level.slots, seq_lens_sum=int(level.seq_lens.sum()),
            logits_indices=torch.arange(rows, device=self.device), req_to_token_pool=self.pool,
            kv_cache=self.kv_cache, attn_backend=self.attn_backend,
        )
        if self.graphs is not None and self.graphs.can_run(batch):
            logits, self._hidden = self.graphs.replay(batch, features)
            return logits
        self.attn_backend.init_forward_metadata(batch)
        self._hidden = self.head(level.tokens, batch.positions, features, batch)
        return self.head.logits(self._hidden)

    def release_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
