"""Turning an embedding step's pooled parts into request state and ReqOutputs (``model.task: embed``).

A prompt's parts arrive one step late, as sampled tokens do; a chunked prompt's parts are joined chunk by chunk
(``Pooling.combine``), and its last chunk finishes the vector (``Pooling.finish``, then unit length when
``model.normalize_embeddings``). The request then ends: its KV stays in the radix cache for later prompts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from treadle.core.embedding.pooling import Pooling
from treadle.core.execution.overlap import LaunchedStep
from treadle.core.request import FinishReason
from treadle.core.scheduling.output import req_output
from treadle.core.scheduling.state import SchedulerState

if TYPE_CHECKING:
    from treadle.core.scheduling.lifecycle import RequestLifecycle


class EmbeddingOutputs:
    """Applies a step's pooled parts once they are on the host and queues the finished vectors in ``state.outputs``."""

    def __init__(self, state: SchedulerState, lifecycle: "RequestLifecycle", pooling: Pooling,
                 normalize: bool) -> None:
        self.state = state
        self.lifecycle = lifecycle
        self.pooling = pooling
        self.normalize = normalize

    def process(self, step: LaunchedStep, host: dict[str, Any]) -> None:
        parts = host["pooled"]
        pooling, outputs = self.pooling, self.state.outputs
        for i, entry in enumerate(step.batch.entries):
            req = entry.req
            if entry.completes_sequence:
                req.pending_tokens -= 1
            if req.finished or req.kv_len < entry.kv_start + entry.extend_len:
                continue  # aborted, or retracted while in flight: its chunks are computed again
            part = parts[i]
            req.pooled = part if req.pooled is None else pooling.combine(req.pooled, part, entry.kv_start)
            if not entry.completes_sequence:
                continue
            vector = pooling.finish(req.pooled, len(req.origin_input_ids))
            if self.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            req.embedding, req.pooled = vector.tolist(), None
            req.finish(FinishReason.STOP, None)
            self.lifecycle.finish(req)
            output = req_output(req, [])
            output.embedding = req.embedding
            outputs.append(output)
