"""Triton kernels of a draft tree verify step (core/speculative/tree.py), one program per request (imported only on
a CUDA device, or under ``TRITON_INTERPRET=1`` in tests):

- :func:`tree_layout`: each node's parent, ancestors and depth (``TreeLayout``), computed before the target's
  forward while the device waits for it: in torch about fifteen small launches (a one-hot, three squarings of the
  reachability matrix, a sum), here one;
- :func:`kept_path`: the kept path, how many drafts it keeps and its tokens (``kept_path`` and the gather of
  ``verify_tree``): in torch about twenty-five small launches, here one.

At a batch of one a verify step is a few milliseconds of device work, and each launch costs the host several
microseconds more than the device spends on it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_layout_kernel(Draft_parents, Parents, Ancestors, Depth, t, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    nodes = tl.arange(0, BLOCK)
    valid = nodes < t
    drafts = Draft_parents + row * (t - 1)
    # Node a > 0 is draft a - 1, whose parent draft p is node p + 1; the root (node 0) is its own parent.
    parents = tl.load(drafts + nodes - 1, mask=valid & (nodes > 0), other=-1).to(tl.int64) + 1
    tl.store(Parents + row * t + nodes, parents, mask=valid)
    # Walk every node up to the root at once, marking each node passed (the root's parent is itself, so a node
    # that got there stays there); a tree of t nodes is at most t - 1 deep.
    current = nodes.to(tl.int64)
    depth = tl.zeros([BLOCK], tl.int64)
    ancestors = nodes[None, :] == nodes[:, None]
    for _ in range(1, t):
        depth += (current > 0).to(tl.int64)
        current = tl.load(drafts + current - 1, mask=valid & (current > 0), other=-1).to(tl.int64) + 1
        ancestors = ancestors | (nodes[None, :] == current[:, None])
    tl.store(Depth + row * t + nodes, depth, mask=valid)
    tl.store(Ancestors + (row * t + nodes[:, None]) * t + nodes[None, :], ancestors.to(tl.uint8),
             mask=valid[:, None] & valid[None, :])


def tree_layout(draft_parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(parents [bs, t] int64, ancestors [bs, t, t] bool, depth [bs, t] int64)`` of ``draft_parents``
    ``[bs, t - 1]`` (each draft's parent draft, -1: the root; parents before their children), as
    ``TreeLayout.of`` defines them."""
    bs, n = draft_parents.shape
    t = n + 1
    draft_parents = draft_parents.contiguous()
    ints = torch.empty((2, bs, t), dtype=torch.int64, device=draft_parents.device)
    ancestors = torch.empty((bs, t, t), dtype=torch.uint8, device=draft_parents.device)
    if bs:
        _tree_layout_kernel[(bs,)](draft_parents, ints[0], ancestors, ints[1], t,
                                   BLOCK=max(triton.next_power_of_2(t), 16))
    return ints[0], ancestors.view(torch.bool), ints[1]


@triton.jit
def _kept_path_kernel(Parents, Ancestors, Depth, Draft_ids, Node_tokens, Path, Accepted, Token_ids, t,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    nodes = tl.arange(0, BLOCK)
    valid = nodes < t
    parents = tl.load(Parents + row * t + nodes, mask=valid, other=0)
    depth = tl.load(Depth + row * t + nodes, mask=valid, other=0)
    parent_tokens = tl.load(Node_tokens + row * t + parents, mask=valid, other=0)
    drafts = tl.load(Draft_ids + row * (t - 1) + nodes - 1, mask=valid & (nodes > 0), other=0)
    wrong = valid & (nodes > 0) & (drafts.to(tl.int64) != parent_tokens.to(tl.int64))
    tile = valid[:, None] & valid[None, :]
    ancestors = tl.load(Ancestors + (row * t + nodes[:, None]) * t + nodes[None, :], mask=tile, other=0) != 0
    # A node is reachable when no draft on its way is wrong; the kept node is the deepest, the first among equals.
    reachable = tl.max((ancestors & wrong[None, :]).to(tl.int32), axis=1) == 0
    score = tl.where(reachable & valid, depth * t + (t - 1 - nodes), -1)
    best = tl.max(score, axis=0)
    last = tl.min(tl.where(score == best, nodes, BLOCK), axis=0)
    accepted = tl.sum(tl.where(nodes == last, depth, 0), axis=0)
    on_path = tl.max(tl.where(nodes[:, None] == last, ancestors.to(tl.int32), 0), axis=0) != 0
    # path[d]: the node of the path at depth d (d <= accepted), then the kept node again.
    at_depth = on_path[None, :] & (depth[None, :] == nodes[:, None])
    path = tl.sum(tl.where(at_depth, nodes[None, :], 0), axis=1)
    path = tl.where(nodes <= accepted, path, last)
    tl.store(Path + row * t + nodes, path.to(tl.int64), mask=valid)
    tl.store(Token_ids + row * t + nodes, tl.load(Node_tokens + row * t + path, mask=valid, other=0), mask=valid)
    tl.store(Accepted + row, accepted.to(tl.int64))


def kept_path(parents: torch.Tensor, ancestors: torch.Tensor, depth: torch.Tensor, draft_ids: torch.Tensor,
              node_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(path [bs, t], accepted [bs], token_ids [bs, t])``: core/speculative/tree.py's ``kept_path`` of the layout
    ``(parents, ancestors, depth)``, ``draft_ids`` ``[bs, t - 1]`` and ``node_tokens`` ``[bs, t]``, and the tokens
    of the path's nodes (``node_tokens`` gathered along ``path``)."""
    bs, t = depth.shape
    node_tokens = node_tokens.contiguous()
    path = torch.empty((bs, t), dtype=torch.int64, device=depth.device)
    accepted = torch.empty((bs,), dtype=torch.int64, device=depth.device)
    token_ids = torch.empty_like(node_tokens)
    if bs:
        _kept_path_kernel[(bs,)](parents.contiguous(), ancestors.contiguous().view(torch.uint8), depth.contiguous(),
                                 draft_ids.contiguous(), node_tokens, path, accepted, token_ids, t,
                                 BLOCK=max(triton.next_power_of_2(t), 16))
    return path, accepted, token_ids
