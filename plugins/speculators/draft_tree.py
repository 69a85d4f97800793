"""Draft trees (``speculative.topk`` > 1) grown the EAGLE-2 way, by the ``draft`` and ``eagle3`` speculators.

From the drafter's logits at each request's last token, the ``topk`` likeliest tokens are the first level. Each
further level feeds the ``topk`` frontier nodes of every request to the drafter in one decode step and scores their
``topk`` children by cumulative log-probability; the ``topk`` best of those ``topk * topk`` children are the next
frontier. After ``num_drafts - topk + 1`` levels (a chain's depth when ``topk`` is 1) the ``num_drafts`` nodes of
highest cumulative log-probability form the tree: a child never scores above its parent, so the chosen nodes hold
their ancestors, and candidates are numbered level by level, so parents come first.

A frontier node attends to its request's KV and to its own ancestors. Each request of the batch borrows ``topk``
scratch rows of a request table (one per frontier node): a row holds the request's table up to its last token,
then the slots of the node's ancestors, so the decode step needs no tree mask. The scratch rows and the slots the
frontier nodes write their K/V to are taken once, when the speculator is built, for ``speculative.max_batch_size``
requests. The drafter runs each level's decode step (:class:`TreeLevel`); everything runs on the device without
waiting for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from treadle.core.execution.overlap import to_device

if TYPE_CHECKING:
    from treadle.core.execution.worker import ModelWorker


@dataclass
class TreeLevel:
    """One decode step of a tree's frontier, ``m * k`` rows (request ``i``'s frontier node ``b`` at row
    ``i * k + b``): each row's scratch table row, input token (a target id), position (device), sequence length
    (host), KV slot (device); ``parent_branch`` ``[m, k]``: which frontier node of the level before each node's
    parent is (None at the first level, whose parent is the request's last token)."""

    rows: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    seq_lens: torch.Tensor
    slots: torch.Tensor
    parent_branch: torch.Tensor | None


# Runs one level's decode step; returns its logits [m * k, vocab] (the drafter's vocabulary).
LevelStep = Callable[[TreeLevel], torch.Tensor]


class DraftTrees:
    """Grows draft trees of width ``topk`` for up to ``rows.shape[0]`` requests a step (module docstring).

    ``table``: the request table the scratch ``rows`` ``[max_requests, topk]`` belong to, read by the drafter's
    decode steps; ``source_table``: the one requests' own rows are in (default ``table``); ``slots``
    ``[max_requests, topk, levels - 1]``: the KV slots the frontier nodes write to. Host tensors."""

    def __init__(self, table: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, topk: int,
                 num_draft_tokens: int, device: torch.device, source_table: torch.Tensor | None = None) -> None:
        self.table = table
        self.source_table = table if source_table is None else source_table
        self.topk = topk
        self.levels = max(1, num_draft_tokens - topk + 1)
        self.rows, self.slots = rows, slots
        self.device = device
        self.rows_dev = to_device(rows, device)

    @classmethod
    def for_worker(cls, draft: "ModelWorker", topk: int, num_draft_tokens: int, max_requests: int) -> "DraftTrees":
        """Scratch rows and slots taken from the draft model's own request table and KV pool."""
        info = draft.info
        rows = [info.req_to_token_pool.alloc() for _ in range(max_requests * topk)]
        if any(row is None for row in rows):
            raise RuntimeError(f"the draft model's request table has no {max_requests * topk} rows to spare for "
                               f"draft trees (speculative.topk {topk}, max_batch_size {max_requests})")
        depth = scratch_depth(topk, num_draft_tokens)
        count = max_requests * topk * depth
        slots = info.allocator.alloc_extend([0], [count], [-1])
        if slots is None:
            raise RuntimeError(f"the draft model's KV pool has no {count} slots to spare for draft trees")
        return cls(info.req_to_token_pool.req_to_token, torch.tensor(rows, dtype=torch.int64).view(max_requests, topk),
                   slots.to(torch.int64).view(max_requests, topk, depth), topk, num_draft_tokens, info.device)

    def grow(self, root_logits: torch.Tensor, main_rows: list[int], last: list[int], num_drafts: int,
             vocab_size: int, step: LevelStep, token_map: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_ids, parents)`` ``[m, num_drafts]`` for ``m`` requests whose drafter logits at their last token
        (position ``last[i]``, in row ``main_rows[i]`` of the source table) are ``root_logits`` ``[m, vocab]``.
        ``token_map`` (a drafter vocabulary smaller than the target's): drafter id -> target id."""
        m, device = len(main_rows), self.device
        k = min(self.topk, num_drafts)
        levels = max(1, num_drafts - k + 1)
        tokens, scores = _top_children(root_logits[:, :vocab_size], k, None)
        tokens = tokens if token_map is None else token_map[tokens]
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
            logits = step(TreeLevel(rows.flatten(), tokens.flatten(), to_device(positions, device), positions + 1,
                                    to_device(slots, device), parent_branch))
            children, child_scores = _top_children(logits[:, :vocab_size], k, scores.flatten())
            children = children if token_map is None else token_map[children]
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
        width = max(last) + 1
        sources = to_device(torch.tensor(main_rows, dtype=torch.int64).repeat_interleave(k), self.device)
        self.table[rows.flatten(), :width] = self.source_table[sources, :width].to(self.table.dtype)

    def _extend_rows(self, rows: torch.Tensor, columns: torch.Tensor, level: int, parent_branch: torch.Tensor | None,
                     k: int) -> None:
        """Before feeding level ``level``'s frontier: each node's scratch row takes its parent's ancestor slots
        (the parent's row, read before any row is written), then its own slot at its depth."""
        table = self.table
        m = rows.shape[0]
        if parent_branch is not None and level > 1:
            ancestors = columns[:, None, :level - 1].expand(m, k, level - 1)
            parent_rows = rows.gather(1, parent_branch)
            table[rows[:, :, None].expand_as(ancestors), ancestors] = table[parent_rows[:, :, None].expand_as(ancestors),
                                                                            ancestors]
        own = to_device(self.slots[:m, :k, level - 1], self.device).to(table.dtype)
        table[rows, columns[:, level - 1:level].expand(m, k)] = own


def scratch_depth(topk: int, num_draft_tokens: int) -> int:
    """The scratch KV slots one frontier node of a tree holds: one per level fed to the drafter (at least one)."""
    return max(1, num_draft_tokens - topk)


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
