"""The worker of an embedding model (``model.task: embed``): each step pools its requests' final hidden states.

An :class:`EmbeddingWorker` wraps the :class:`~treadle.core.execution.worker.ModelWorker` that owns the model and
its KV memory. Its steps are prefills only: the model returns every row's final hidden state
(``compute_hidden_states``) instead of logits, the pooling reduces each request's rows of the step to one part
(``[bs, hidden]`` on the device), and "sampling" only starts that part's copy to the host (``results["pooled"]``).
The scheduler joins a chunked prompt's parts and finishes the vector (core/scheduling/embedding_output.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from treadle.core.embedding.pooling import Pooling, PoolingChunk
from treadle.core.execution.forward_batch import ForwardBatch
from treadle.core.execution.forward_inputs import build_forward_batch, token_owners
from treadle.core.execution.overlap import HostCopy, LaunchedStep, to_device
from treadle.core.execution.worker import ModelWorker, Worker

if TYPE_CHECKING:
    from treadle.core.scheduling.schedule_batch import ScheduleBatch


class EmbeddingWorker(Worker):
    """Pools instead of sampling (see the module docstring); ``pooling`` is the registered one the config names."""

    def __init__(self, target: ModelWorker, pooling: Pooling) -> None:
        self.target = target
        self.runner = target.runner
        self.info = target.info
        self.config = target.config
        self.pooling = pooling

    def launch_forward(self, batch: "ScheduleBatch", draft_ids: torch.Tensor | None = None) -> LaunchedStep:
        runner, target = self.runner, self.target
        batch.write_req_to_token(runner.req_to_token_pool.req_to_token)
        forward_batch = build_forward_batch(batch, target.context, runner.attn_backend, target.next_input_ids)
        with torch.inference_mode():
            hidden = runner.forward_hidden_states(forward_batch)
            pooled = self.pooling.reduce(hidden, pooling_chunk(batch, forward_batch))
        return LaunchedStep(batch, forward_batch, None, pooled=pooled)

    def launch_sampling(self, step: LaunchedStep, vocab_mask: torch.Tensor | None = None,
                        prompt_logprob_entries: Sequence[int] = ()) -> None:
        """Nothing to sample: start the pooled parts' copy home."""
        step.results = HostCopy({"pooled": step.pooled})
        step.pooled = None

    def release_graphs(self) -> None:
        self.target.release_graphs()


def pooling_chunk(batch: "ScheduleBatch", forward_batch: ForwardBatch) -> PoolingChunk:
    """Where each entry's rows lie in the step's hidden states."""
    entries = batch.entries
    owner, _ = token_owners([e.extend_len for e in entries])
    return PoolingChunk(
        starts=forward_batch.extend_start_loc, lens=forward_batch.extend_seq_lens,
        owner=to_device(owner, forward_batch.input_ids.device),
        first_positions=[e.kv_start for e in entries],
        prompt_lens=[len(e.req.origin_input_ids) for e in entries],
    )
