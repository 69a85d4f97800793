"""Step observers: how a benchmark or a tracer follows the scheduler's steps, instead of patching it.

A ``StepObserver`` is told of a scheduler's step events in order. Register one with
``scheduler.add_observer(observer)`` and remove it with ``scheduler.remove_observer(observer)``. Every method
does nothing by default: override the ones you need. One ``step()`` call tells its observers, in this order:

1. ``step_started()``;
2. ``requests_admitted(reqs)`` when prompts leave the waiting queue for the batch being built;
3. ``batch_built(batch)`` (``None``: nothing to run this step);
4. ``forward_launching(batch)`` and ``forward_launched(batch, step)`` around queueing the forward on the device
   (``step`` is ``None`` when the device ran out of memory and the batch was undone);
5. for the step read now (the previous one under overlap scheduling): ``results_waiting(step)`` before the host
   waits for its sampled tokens, ``results_arrived(step)`` once they are on the host, ``step_settled(step)``
   once they are appended and its outputs queued;
6. ``sampling_launching(step)`` and ``sampling_launched(step)`` around queueing the new batch's sampling;
7. with overlap off, 5 again for the new batch;
8. ``step_ended(outputs)`` with what ``step()`` returns.

When the step in flight is a verify step (a speculative worker's TARGET_VERIFY batch), the host waits for it
before building the new batch: its ``results_waiting`` and ``results_arrived`` come right after
``step_started`` too, and again in 5 (with nothing left to wait for) before its tokens are appended.

``request_retracted(req)`` and ``request_finished(req)`` come whenever that happens (a retraction while a
decode batch is built, a request that finishes while a step is read, an abort). A step may also be read
outside ``step()`` (``flush_cache``, an out-of-memory retry), with the events of 5.

Observers run on the scheduler's thread inside the step: keep them cheap, never synchronize the device, and
never change the scheduler's state. With none registered the scheduler pays one empty-list check per event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from treadle.core.execution.overlap import LaunchedStep
    from treadle.core.request import Req, ReqOutput
    from treadle.core.scheduling.schedule_batch import ScheduleBatch


class StepObserver:
    """Receives a scheduler's step events (module docstring); every method is a no-op to override."""

    def step_started(self) -> None:
        """A ``step()`` call begins."""

    def requests_admitted(self, reqs: list["Req"]) -> None:
        """These waiting requests were admitted into the batch being built (a continuing chunk is not)."""

    def batch_built(self, batch: "ScheduleBatch | None") -> None:
        """This step's batch (None: nothing to run), before its forward is queued."""

    def forward_launching(self, batch: "ScheduleBatch") -> None:
        """The batch's forward is about to be queued on the device."""

    def forward_launched(self, batch: "ScheduleBatch", step: "LaunchedStep | None") -> None:
        """The forward was queued (``step``), or ran out of device memory and the batch was undone (None)."""

    def results_waiting(self, step: "LaunchedStep") -> None:
        """The host is about to wait for this launched step's sampled tokens."""

    def results_arrived(self, step: "LaunchedStep") -> None:
        """The step's sampled tokens are on the host; processing them begins."""

    def step_settled(self, step: "LaunchedStep") -> None:
        """The step's tokens were appended, finished requests ended and the outputs queued."""

    def sampling_launching(self, step: "LaunchedStep") -> None:
        """The step's sampling is about to be queued on the device."""

    def sampling_launched(self, step: "LaunchedStep") -> None:
        """The step's sampling and the copy of its tokens to the host were queued."""

    def request_retracted(self, req: "Req") -> None:
        """A running request (or the chunked prompt) went back to the queue; its KV memory was released."""

    def request_finished(self, req: "Req") -> None:
        """A request ended (``req.finished_reason`` says how, an abort included) and left the scheduler."""

    def step_ended(self, outputs: list["ReqOutput"]) -> None:
        """``step()`` returns these outputs."""


class StepObservers(list):
    """The registered observers, told of each event in registration order.

    A list, so that ``if observers:`` is the one check the scheduler makes when nobody observes it.
    """

    def step_started(self) -> None:
        for observer in self:
            observer.step_started()

    def requests_admitted(self, reqs: list["Req"]) -> None:
        for observer in self:
            observer.requests_admitted(reqs)

    def batch_built(self, batch: "ScheduleBatch | None") -> None:
        for observer in self:
            observer.batch_built(batch)

    def forward_launching(self, batch: "ScheduleBatch") -> None:
        for observer in self:
            observer.forward_launching(batch)

    def forward_launched(self, batch: "ScheduleBatch", step: "LaunchedStep | None") -> None:
        for observer in self:
            observer.forward_launched(batch, step)

    def results_waiting(self, step: "LaunchedStep") -> None:
        for observer in self:
            observer.results_waiting(step)

    def results_arrived(self, step: "LaunchedStep") -> None:
        for observer in self:
            observer.results_arrived(step)

    def step_settled(self, step: "LaunchedStep") -> None:
        for observer in self:
            observer.step_settled(step)

    def sampling_launching(self, step: "LaunchedStep") -> None:
        for observer in self:
            observer.sampling_launching(step)

    def sampling_launched(self, step: "LaunchedStep") -> None:
        for observer in self:
            observer.sampling_launched(step)

    def request_retracted(self, req: "Req") -> None:
        for observer in self:
            observer.request_retracted(req)

    def request_finished(self, req: "Req") -> None:
        for observer in self:
            observer.request_finished(req)

    def step_ended(self, outputs: list["ReqOutput"]) -> None:
        for observer in self:
            observer.step_ended(outputs)
