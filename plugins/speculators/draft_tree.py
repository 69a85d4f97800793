"""Draft trees of the ``draft`` speculator (``speculative.topk`` > 1), grown the EAGLE-2 way.

From the draft model's logits at each request's last token, the ``topk`` likeliest tokens are the first level.
Each further level feeds the ``topk`` frontier nodes of every request to the draft model in one decode step and
scores their ``topk`` children by cumulative log-probability; the ``topk`` best of those ``topk * topk`` children are
the next frontier. After ``num_drafts - topk + 1`` levels (a chain's depth when ``topk`` is 1) the ``num_drafts``
nodes of highest cumulative log-probability form the tree: a child never scores above its parent, so the chosen
nodes hold their ancestors, and candidates are numbered level by level, so parents come first.

A frontier node attends to its request's KV and to its own ancestors. Each request of the batch borrows ``topk``
scratch rows of the draft's request table (one per frontier node): a row holds the request's table up to its last
token, then the slots of the node's ancestors, so the decode step needs no tree mask. The scratch rows and the
slots the frontier nodes write their K/V to are taken once, when the speculator is built, for
``speculative.max_batch_size`` requests. Everything runs on the device without waiting for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from treadle.core.execution.overlap import to_device

if TYPE_CHECKING:
    from treadle.core.execution.forward_batch import ForwardBatch
    from treadle.core.execution.worker import ModelWorker


DecodeBatch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                       "ForwardBatch"]


class DraftTrees:
    """Grows draft trees with the draft model ``draft`` for up to ``max_requests`` requests a step."""

    def __init__(self, draft: "ModelWorker", topk: int, num_draft_tokens: int, max_requests: int) -> None:
        self.draft = draft
        self.topk = topk
        self.levels = max(1, num_draft_tokens - topk + 1)
        info = draft.info
        rows = [info.req_to_token_pool.alloc() for _ in range(max_requests * topk)]
        if any(row is None for row in rows):
            raise RuntimeError(f"the draft model's request table has no {max_requests * topk} rows to spare for "
                               f"draft trees (speculative.topk {topk}, max_batch_size {max_requests})")
        count = max_requests * topk * max(self.levels - 1, 1)
        slots = info.allocator.alloc_extend([0], [count], [-1])
        if slots is None:
            raise RuntimeError(f"the draft model's KV pool has no {count} slots to spare for draft trees")
        self.rows = torch.tensor(rows, dtype=torch.int64).view(max_requests, topk)
        self.slots = slots.to(torch.int64).view(max_requests, topk, max(self.levels - 1, 1))
        self.device = info.device
        self.rows_dev = to_device(self.rows, self.device)

    def grow(self, root_logits: torch.Tensor, main_rows: list[int], last: list[int], num_drafts: int,
             vocab_size: int, decode_batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_ids, parents)`` ``[m, num_drafts]`` for ``m`` requests whose draft logits at their last token
        (position ``last[i]``, in draft table row ``main_rows[i]``) are ``root_logits`` ``[m, vocab]``."""
        m, device = len(main_rows), self.device
        k = min(self.topk, num_drafts)
        levels = max(1, num_drafts - k + 1)
        tokens, scores = _top_children(root_logits[:, :vocab_size], k, None)
        cand_tokens, cand_scores = [tokens], [scores]
        cand_parents = [torch.full((m, k), -1, dtype=torch.int64, device=device)]
        frontier_ids = torch.arange(k, device=device).expand(m, k)
        rows = self.rows_dev[:m, :k]
        if levels > 1:
            self._copy_prefixes(rows, main_rows, last, k)
        columns = to_device(torch.tensor(last, dtype=torch.int64)[:, None] + 1 + torch.arange(levels), device)
        parent_branch = None
        offset = k
        for level in range(1, levels):
            self._extend_rows(rows, columns, level, parent_branch, k)
            positions = torch.tensor(last, dtype=torch.int64).repeat_interleave(k) + level
            slots = self.slots[:m, :k, level - 1].flatten()
            logits = self.draft.forward(decode_batch(
                rows.flatten(), tokens.flatten(), to_device(positions, device), positions + 1,
                to_device(slots, device), torch.arange(m * k, device=device)))
            children, child_scores = _top_children(logits[:, :vocab_size], k, scores.flatten())
            children, child_scores = children.view(m, k * k), child_scores.view(m, k * k)
            cand_tokens.append(children)
            cand_scores.append(child_scores)
            cand_parents.append(frontier_ids.repeat_interleave(k, dim=1))
            scores, best = child_scores.topk(k, dim=1)
            tokens = children.gather(1, best)
            frontier_ids = offset + best
            parent_branch = best // k
            offset += k * k
        return _best_nodes(torch.cat(cand_tokens, 1), torch.cat(cand_scores, 1), torch.cat(cand_parents, 1),
                           num_drafts)

    def _copy_prefixes(self, rows: torch.Tensor, main_rows: list[int], last: list[int], k: int) -> None:
        """Each scratch row takes its request's table up to its last token."""
        table = self.draft.info.req_to_token_pool.req_to_token
        width = max(last) + 1
        sources = to_device(torch.tensor(main_rows, dtype=torch.int64).repeat_interleave(k), self.device)
        table[rows.flatten(), :width] = table[sources, :width]

    def _extend_rows(self, rows: torch.Tensor, columns: torch.Tensor, level: int, parent_branch: torch.Tensor | None,
                     k: int) -> None:
        """Before feeding level ``level``'s frontier: each node's scratch row takes its parent's ancestor slots
        (the parent's row, read before any row is written), then its own slot at its depth."""
        table = self.draft.info.req_to_token_pool.req_to_token
        m = rows.shape[0]
        if parent_branch is not None and level > 1:
            ancestors = columns[:, None, :level - 1].expand(m, k, level - 1)
            parent_rows = rows.gather(1, parent_branch)
            table[rows[:, :, None].expand_as(ancestors), ancestors] = table[parent_rows[:, :, None].expand_as(ancestors),
                                                                            ancestors]
        own = to_device(self.slots[:m, :k, level - 1], self.device).to(table.dtype)
        table[rows, columns[:, level - 1:level].expand(m, k)] = own


def _top_children(logits: torch.Tensor, k: int, parent_scores: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` likeliest tokens of each row and their cumulative log-probabilities (``[rows, k]`` each)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    scores, tokens = log_probs.topk(k, dim=-1)
    if parent_scores is not None:
        scores = scores + parent_scores.unsqueeze(1)
    return tokens, scores


def _best_nodes(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, n: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``n`` candidates of highest score per row, in candidate order, with their parents renumbered among them.
    A stable sort keeps a parent ahead of an equal-scoring child (parents have lower candidate numbers)."""
    m, count = tokens.shape
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]
    chosen = torch.sort(order, dim=1).values
    renumber = torch.full((m, count), -1, dtype=torch.int64, device=tokens.device)
    renumber.scatter_(1, chosen, torch.arange(n, device=tokens.device).expand(m, n))
    chosen_parents = parents.gather(1, chosen)
    new_parents = torch.where(chosen_parents < 0, -1, renumber.gather(1, chosen_parents.clamp_min(0)))
    return tokens.gather(1, chosen), new_parents
