"""Draft trees (``speculative.topk > 1``): the shape of a tree verify step, which path the target keeps, and
moving that path's K/V into place.

A verify row of a tree carries ``t`` nodes: node 0 is the request's last sampled token (the root), node ``j + 1``
is draft ``j``, whose parent is ``parents[j] + 1`` (``parents[j]`` -1: the root). Parents come before their
children, so a chain is ``parents[j] = j - 1``. Every node sits at the position ``kv_start + depth`` and attends to
the request's KV and to its own ancestors (:class:`TreeLayout`); its KV is written at the slot of position
``kv_start + node``, so after the step the kept path's K/V is copied to the slots of positions ``kv_start + depth``
(:func:`compact_kept_path`) and the scheduler gives back the slots past it, as it does for a chain.

Which path is kept (:func:`kept_path`): the longest root-to-node path whose every draft equals the token the target
produced at its parent (its argmax, or its seeded sample). For drafts without distributions this is exact multi-draft
rejection sampling: trying a node's children in turn, each kept with probability ``p(x) / residual mass`` and the
residual losing ``x`` otherwise, keeps child ``x`` exactly when a sample from ``p`` equals ``x``, and a sample that
matches no child is distributed as the residual. Nothing here leaves the device.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from treadle.core.execution.sampler import Sampler, SamplingBatch


@dataclass
class TreeLayout:
    """One tree verify batch's shape on the device: ``parents`` ``[bs, t]`` (each node's parent node; the root's is
    itself), ``ancestors`` ``[bs, t, t]`` bool (``[i, a, b]``: node ``b`` is node ``a`` or one of its ancestors, what
    node ``a`` attends to among the step's tokens) and ``depth`` ``[bs, t]`` int64 (the root's 0)."""

    parents: torch.Tensor
    ancestors: torch.Tensor
    depth: torch.Tensor

    @classmethod
    def of(cls, draft_parents: torch.Tensor) -> "TreeLayout":
        """From ``draft_parents`` ``[bs, t - 1]`` (each draft's parent draft, -1: the root): on a CUDA device in
        one kernel (kernels/draft_trees.py; the target's forward waits for it), elsewhere :meth:`by_squaring`."""
        kernels = _tree_kernels() if draft_parents.device.type == "cuda" else None
        return cls(*kernels.tree_layout(draft_parents)) if kernels is not None else cls.by_squaring(draft_parents)

    @classmethod
    def by_squaring(cls, draft_parents: torch.Tensor) -> "TreeLayout":
        """The layout in torch operations, by pointer jumping: after ``r`` squarings of the reachability matrix a
        node sees its ancestors up to ``2 ** r`` levels up."""
        bs, n = draft_parents.shape
        t = n + 1
        device = draft_parents.device
        parents = torch.cat([torch.zeros(bs, 1, dtype=torch.int64, device=device),
                             draft_parents.to(device=device, dtype=torch.int64) + 1], dim=1)
        reach = torch.zeros(bs, t, t, device=device).scatter_(2, parents.unsqueeze(2), 1.0)
        reach = reach + torch.eye(t, device=device)
        for _ in range(max(1, math.ceil(math.log2(t)))):
            reach = torch.bmm(reach, reach).clamp_(max=1.0)
        ancestors = reach > 0
        return cls(parents, ancestors, ancestors.sum(dim=2) - 1)


@functools.cache
def _tree_kernels():
    """The module ``kernels/draft_trees.py`` where Triton is installed, else None."""
    if importlib.util.find_spec("triton") is None:
        return None
    from treadle.kernels import draft_trees

    return draft_trees


def warm_up_tree_kernels(device: torch.device, num_drafts: int) -> None:
    """Compile the tree kernels (kernels/draft_trees.py) before a request waits for them: a tree of
    ``num_drafts`` drafts through the layout and the kept path, on a CUDA device with Triton (else nothing)."""
    kernels = _tree_kernels() if device.type == "cuda" else None
    if kernels is None:
        return
    layout = TreeLayout.of(chain_parents(1, num_drafts, device))
    tokens = torch.zeros(1, num_drafts + 1, dtype=torch.int64, device=device)
    kernels.kept_path(layout.parents, layout.ancestors, layout.depth, tokens[:, 1:], tokens)


def chain_parents(bs: int, n: int, device: torch.device) -> torch.Tensor:
    """``[bs, n]``: the parents of a chain of ``n`` drafts (each draft's parent is the draft before it)."""
    return (torch.arange(n, dtype=torch.int64, device=device) - 1).expand(bs, n)


def kept_path(layout: TreeLayout, draft_ids: torch.Tensor, node_tokens: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(path [bs, t], accepted [bs])``: the nodes of the kept path by depth (``path[i, d]`` the node at depth
    ``d`` for ``d <= accepted[i]``; past it the kept node repeats) and how many drafts it keeps.

    ``draft_ids`` ``[bs, t - 1]``; ``node_tokens`` ``[bs, t]``: the target's token at each node (argmax or seeded
    sample). A draft is right when it equals its parent's token; the kept node is the deepest whose drafts on the
    way are all right (the first in node order among equals)."""
    ancestors, depth = layout.ancestors, layout.depth
    bs, t = depth.shape
    device = depth.device
    parent_tokens = node_tokens.gather(1, layout.parents)
    right = torch.cat([torch.ones(bs, 1, dtype=torch.bool, device=device),
                       draft_ids.to(node_tokens.dtype) == parent_tokens[:, 1:]], dim=1)
    reachable = ~(ancestors & ~right.unsqueeze(1)).any(dim=2)
    nodes = torch.arange(t, device=device)
    score = torch.where(reachable, depth * t + (t - 1 - nodes), -1)
    last = score.argmax(dim=1)
    accepted = depth.gather(1, last.unsqueeze(1)).squeeze(1)
    on_path = ancestors.gather(1, last.view(bs, 1, 1).expand(bs, 1, t)).squeeze(1)
    # Each node of the path goes to the column of its depth, every other node to a spare column t.
    at_depth = torch.where(on_path, depth, t)
    path = torch.zeros(bs, t + 1, dtype=torch.int64, device=device).scatter_(1, at_depth, nodes.expand(bs, t))
    levels = nodes.unsqueeze(0)
    return torch.where(levels <= accepted.unsqueeze(1), path[:, :t], last.unsqueeze(1)), accepted


@dataclass
class TreeVerdict:
    """What a tree verify step keeps, laid out as a chain's: ``token_ids`` ``[bs, t]`` (the kept drafts, then the
    target's token after them, at ``accepted``), ``accepted`` ``[bs]``, ``path`` ``[bs, t]`` (:func:`kept_path`),
    and the log-probs of ``token_ids`` (``[bs, t]``; top ``[bs, t, n]`` values and ids) when asked for."""

    token_ids: torch.Tensor
    accepted: torch.Tensor
    path: torch.Tensor
    logprobs: torch.Tensor | None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None


def verify_tree(sampler: "Sampler", logits: torch.Tensor, sampling: "SamplingBatch", tree: TreeLayout,
                draft_ids: torch.Tensor, vocab_mask: torch.Tensor | None = None) -> TreeVerdict:
    """Sample the target's token at every node (``logits`` ``[bs * t, vocab]``, request ``i``'s node ``a`` at row
    ``i * t + a``; a sampled node's output position is its depth past the request's last token, so the nodes of one
    path draw independent noise) and keep the path that matches it (:func:`kept_path`)."""
    bs, t = tree.depth.shape
    if sampling.steps is not None:
        sampling.steps = (sampling.steps.view(bs, t)[:, :1] + tree.depth).flatten()
    result = sampler(logits, sampling, vocab_mask=vocab_mask)
    node_tokens = result.next_token_ids.view(bs, t)
    kernels = _tree_kernels() if node_tokens.device.type == "cuda" else None
    if kernels is not None:  # one launch for what follows in torch
        path, accepted, token_ids = kernels.kept_path(tree.parents, tree.ancestors, tree.depth, draft_ids, node_tokens)
    else:
        path, accepted = kept_path(tree, draft_ids, node_tokens)
        token_ids = node_tokens.gather(1, path)
    logprobs = top = None
    if result.logprobs is not None:
        logprobs = result.logprobs.view(bs, t).gather(1, path)
    if result.top_logprobs is not None:
        values, ids = result.top_logprobs
        columns = path.unsqueeze(2).expand(bs, t, values.shape[-1])
        top = (values.view(bs, t, -1).gather(1, columns), ids.view(bs, t, -1).gather(1, columns))
    return TreeVerdict(token_ids, accepted, path, logprobs, top)


def compact_kept_path(kv_cache, out_cache_loc: torch.Tensor, path: torch.Tensor) -> None:
    """Copy the K/V of each request's kept path (:func:`kept_path`) from the slots of positions ``kv_start + node``
    to those of ``kv_start + depth``, in every layer (``kv_cache``: the target's KVCache; ``out_cache_loc``
    ``[bs * t]``: the step's new slots, request ``i``'s position ``kv_start + j`` at ``i * t + j``). All sources are
    read before any slot is written. Past the kept path a position gets the kept node's K/V: those positions are
    computed again (their slots given back or written) before anything reads them.

    One gather of indices and one gather and scatter over all layers: no host sync, no loop over layers."""
    bs, t = path.shape
    slots = out_cache_loc.view(bs, t)
    kv_cache.copy_slots(slots.gather(1, path).flatten(), out_cache_loc.long())
