"""What the scheduler's parts share: the request queues, the outputs queued for the caller, the counters.

One ``SchedulerState`` per scheduler, passed to each part at construction. The parts change it only within
their job: admission (``prefill.py``) moves requests from ``waiting`` into a batch, ``RequestLifecycle``
(``lifecycle.py``) moves them between the queues and ends them, output processing (``output.py``) queues
``outputs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from treadle.core.request import Req, ReqOutput
from treadle.core.scheduling.observers import StepObservers


@dataclass(eq=False)
class SchedulerState:
    """Where every live request is, what the next ``step()`` returns, and the scheduler's counters."""

    # The share of each running request's remaining max_new_tokens that admission keeps free for it: it decays
    # with every decode step towards scheduler.new_token_ratio and goes back to 1.0 after a retraction.
    new_token_ratio: float
    waiting: list[Req] = field(default_factory=list)
    running: list[Req] = field(default_factory=list)
    chunked_req: Req | None = None  # the prompt part-way through its chunks (it holds KV, samples nothing yet)
    live_by_rid: dict[str, Req] = field(default_factory=dict)  # every queued or running request
    outputs: list[ReqOutput] = field(default_factory=list)  # for the caller of the next step()
    observers: StepObservers = field(default_factory=StepObservers)
    num_retractions: int = 0
    num_finished: int = 0
    cached_tokens_total: int = 0  # prompt tokens served from the prefix cache on first admission

    def forget(self, req: Req) -> None:
        """Take a finished request out of ``live_by_rid`` (its id may be used again)."""
        if self.live_by_rid.get(req.rid) is req:
            del self.live_by_rid[req.rid]

    def take_outputs(self) -> list[ReqOutput]:
        outputs, self.outputs = self.outputs, []
        return outputs


def remaining_new_tokens(req: Req) -> int:
    """Tokens ``req`` may still sample, counting the ones in flight."""
    return max(0, req.sampling_params.max_new_tokens - len(req.output_ids) - req.pending_tokens)


def wants_input_logprobs(req: Req) -> bool:
    """Whether ``req``'s prompt log-probs are still to be computed (asked for, not sent, nothing sampled yet)."""
    return (req.return_logprob and req.logprob_start_len >= 0 and not req.input_logprobs_sent
            and not req.output_ids and req.logprob_start_len < len(req.origin_input_ids))
