"""The ``speculators`` plugin kind: what proposes the draft tokens a speculative worker verifies.

A speculator is built once per rank by its factory, ``factory(target, config, registry)``: ``target`` is the
target's :class:`~treadle.core.execution.worker.ModelWorker`, ``config`` the resolved server config (its
``speculative`` section says how many drafts and which method), ``registry`` the plugin registry (a draft
model is loaded through it like any model). The speculative worker around the target calls it each step:

- :meth:`Speculator.max_drafts` (optional) before a decode batch is built: how many drafts are worth verifying
  for the running requests (an n-gram look-up with nothing to copy says 0, and the step decodes one token);
- :meth:`Speculator.propose` for every TARGET_VERIFY batch, before the target's forward: ``t - 1`` drafts per
  request, where ``t`` is the batch's tokens per request (``entry.extend_len``; the first of those ``t``
  tokens is the request's last sampled token, already known); with ``speculative.topk`` > 1 they may form a
  tree (``Drafts.parents``);
- :meth:`Speculator.propose_on_device` (optional, chains only) instead of ``propose`` for a verify batch queued
  before the host has read the previous verify step's results (overlapped verify, ``speculative.overlap``): where
  each request's last sampled token sits is known only on the device then, and the drafts must be gathered there;
- :meth:`Speculator.after_target_forward` after each forward of the target is queued (prefill chunks and
  verify steps alike): a draft model catches its own KV cache up, EAGLE reads the target's hidden states;
- :meth:`Speculator.request_released` when a request leaves the running batch (finished, aborted or
  retracted): per-request state (a draft model's KV) is freed there.

Nothing here may synchronize the device inside a step. A speculator that needs the host's view of a request
reads it from the batch's entries (``entry.req.origin_input_ids`` and ``entry.req.output_ids``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from treadle.core.execution.overlap import LaunchedStep
    from treadle.core.request import Req
    from treadle.core.scheduling.schedule_batch import ScheduleBatch


@dataclass
class Drafts:
    """One verify batch's proposals.

    ``token_ids`` ``[bs, n]`` int64 on the target's device: request ``i``'s drafts for the positions after its
    last sampled token. ``probs`` ``[bs, n, vocab]`` float32 (or None): the distribution each draft was sampled
    from, for rejection sampling; None means the drafts are deterministic proposals (a lookup, a greedy draft
    model), which rejection sampling treats as one-hot. Under greedy sampling ``probs`` is not read.

    ``parents`` ``[bs, n]`` int64 (or None: a chain) makes each request's drafts a tree (``speculative.topk`` > 1):
    ``parents[i, j]`` is the index of draft ``j``'s parent among the request's drafts, below ``j``, or -1 for a
    child of the request's last sampled token; a chain is ``parents[i, j] = j - 1``. Up to ``n`` nodes, so a node
    of depth ``d`` verifies the position ``d`` past the last token; the target keeps the longest root-to-node path
    it would have produced itself (core/speculative/tree.py). Tree drafts carry no ``probs``: a tree's nodes are
    proposals (a draft model's top-k), kept by matching the target's own token at their parent, which is exact.
    """

    token_ids: torch.Tensor
    probs: torch.Tensor | None = None
    parents: torch.Tensor | None = None


class Speculator(ABC):
    """Proposes draft tokens for the requests of a TARGET_VERIFY batch (module docstring)."""

    #: The most drafts it proposes per request and step (``speculative.num_tokens``).
    num_draft_tokens: int

    @abstractmethod
    def propose(self, batch: "ScheduleBatch", num_drafts: int) -> Drafts:
        """``num_drafts`` drafts for each entry of ``batch`` (``entry.req``: the request so far)."""

    #: Whether :meth:`propose_on_device` is implemented: verify steps may then be overlapped (``speculative.overlap``).
    proposes_on_device: bool = False

    def propose_on_device(self, batch: "ScheduleBatch", num_drafts: int, positions: torch.Tensor,
                          req_pool_indices: torch.Tensor) -> Drafts:
        """``num_drafts`` drafts (a chain, without ``probs``) for each entry of an overlapped verify batch, from
        device state alone: ``positions`` ``[bs]`` (int64, on the device) is where each request's last sampled token
        sits (its drafts go at ``positions + 1 ...``), ``req_pool_indices`` ``[bs]`` its request-table row. The host's
        ``entry.req.output_ids`` and ``entry.kv_start`` lag one verify step behind here: they miss the previous
        step's tokens. Nothing may wait for the device. Only called when ``proposes_on_device`` is True."""
        raise NotImplementedError(f"{type(self).__name__} does not propose drafts on the device")

    def max_drafts(self, reqs: list["Req"]) -> int:
        """The most drafts worth verifying in the next decode step of the running ``reqs``, asked before that
        step's batch is built (each request's last sampled token will sit at position ``req.kv_len``). Below
        ``num_draft_tokens`` the step verifies fewer; 0 makes it a plain one-token decode step. Default: always
        ``num_draft_tokens`` (a speculator that cannot tell in advance)."""
        return self.num_draft_tokens

    def after_target_forward(self, step: "LaunchedStep") -> None:
        """The target's forward of ``step`` was queued (its sampling not yet): default, nothing to do."""

    def request_released(self, req: "Req") -> None:
        """``req`` left the running batch (finished, aborted or retracted): free what is kept for it."""

    def release_graphs(self) -> None:
        """Free any CUDA graphs before the device goes away."""
