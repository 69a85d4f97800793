"""One Triton kernel for a draft tree verify step's layout (core/speculative/tree.py, ``TreeLayout``): each node's
parent, ancestors and depth (imported only on a CUDA device, or under ``TRITON_INTERPRET=1`` in tests).

The layout is computed before the target's forward, while the device waits for it: in torch it is about fifteen
small launches (a one-hot, three squarings of the reachability matrix, a sum), here one.
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
