"""The EAGLE-3 head's decode steps captured in CUDA graphs (one per batch size, up to the largest verify batch), and
the catch-up steps of overlapped verify batches (eagle3_overlap.py) as TARGET_VERIFY graphs of ``t`` tokens per
request.

A decode step of the head is one decoder layer and its lm_head over a few rows: bound by kernel launches. The
graphs are :class:`~treadle.core.execution.cuda_graph.CudaGraphRunner`'s decode graphs over a small module that
reads the step's input features from a static buffer and writes the output hidden state (the next step's
features) to another, so the runner's usual static inputs (token ids, positions, slots, lengths) are all a step
needs. A catch-up step returns every row's logits (the caller picks each request's valid last row).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from treadle.core.execution.cuda_graph import CudaGraphRunner

if TYPE_CHECKING:
    from treadle.core.execution.attention import AttentionBackend
    from treadle.core.execution.attention_context import AttentionContext
    from treadle.core.execution.forward_batch import ForwardBatch
    from treadle.plugins.speculators.eagle3_model import Eagle3Head


class HeadDecodeStep(nn.Module):
    """One decode step of the head with its features in and its hidden state out through static buffers."""

    def __init__(self, head: "Eagle3Head", max_bs: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.head = head
        hidden = head.config.hidden_size
        self.features = torch.zeros(max_bs, hidden, dtype=dtype, device=device)
        self.hidden = torch.zeros(max_bs, hidden, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: "ForwardBatch") -> torch.Tensor:
        rows = input_ids.shape[0]
        hidden = self.head(input_ids, positions, self.features[:rows], forward_batch)
        self.hidden[:rows].copy_(hidden)
        return self.head.logits(hidden)


class HeadDecodeGraphs:
    """Replays the head's decode steps of up to ``max_bs`` requests (``can_run``) through captured graphs."""

    def __init__(self, head: "Eagle3Head", attn_backend: "AttentionBackend", context: "AttentionContext",
                 max_bs: int, catch_up_tokens: Sequence[int] = ()) -> None:
        rows = max_bs * max([1, *catch_up_tokens])
        self.step = HeadDecodeStep(head, rows, context.dtype, context.device)
        self.runner = CudaGraphRunner(self.step, attn_backend, context, max_bs, prune=False,
                                      verify_tokens_per_req=catch_up_tokens, verify_max_bs=max_bs)

    def can_run(self, forward_batch: "ForwardBatch") -> bool:
        return self.runner.can_run(forward_batch) or (forward_batch.tree_mask is None
                                                       and self.runner.can_run_verify(forward_batch))

    def replay(self, forward_batch: "ForwardBatch", features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, output hidden state)`` of a decode or catch-up batch whose input features are ``features``."""
        rows = forward_batch.num_tokens
        self.step.features[:rows].copy_(features)
        if forward_batch.forward_mode.is_verify():
            logits = self.runner.replay_verify(forward_batch)
        else:
            logits = self.runner.replay(forward_batch)
        return logits, self.step.hidden[:rows]

    def release(self) -> None:
        if self.runner.graphs and self.step.features.device.type == "cuda":
            torch.cuda.synchronize(self.step.features.device)
        self.runner.release()
