"""Step observers: a registered StepObserver is told of every step's events, in the documented order
(core/scheduling/observers.py), without changing what the scheduler does."""

from __future__ import annotations

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.core.request import Req
from treadle.core.scheduling.observers import StepObserver
from treadle.testing.engine import assert_kv_accounted

PROMPTS = [[5, 17, 42, 8], [99, 3, 250], [11, 7, 64, 31, 2]]
PARAMS = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 5, 2)]

# Each step's events, as the module docstring lists them: a step that launches a batch reads the step before it
# (under overlap) or itself (without); the last steps only read.
LAUNCH = ["batch_built", "forward_launching", "forward_launched"]
READ = ["results_waiting", "results_arrived", "step_settled"]
SAMPLE = ["sampling_launching", "sampling_launched"]


class EventLog(StepObserver):
    """Records every event by name (request events with the request id)."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.admitted: list[str] = []
        self.finished: dict[str, str] = {}
        self.launched: list[object] = []

    def step_started(self) -> None:
        self.events.append("step_started")

    def requests_admitted(self, reqs: list[Req]) -> None:
        self.events.append("requests_admitted")
        self.admitted += [req.rid for req in reqs]

    def batch_built(self, batch) -> None:
        self.events.append("batch_built" if batch is not None else "no_batch")

    def forward_launching(self, batch) -> None:
        self.events.append("forward_launching")

    def forward_launched(self, batch, step) -> None:
        self.events.append("forward_launched")
        self.launched.append(step)

    def results_waiting(self, step) -> None:
        self.events.append("results_waiting")

    def results_arrived(self, step) -> None:
        self.events.append("results_arrived")

    def step_settled(self, step) -> None:
        self.events.append("step_settled")

    def sampling_launching(self, step) -> None:
        self.events.append("sampling_launching")

    def sampling_launched(self, step) -> None:
        self.events.append("sampling_launched")

    def request_retracted(self, req: Req) -> None:
        self.events.append("request_retracted")

    def request_finished(self, req: Req) -> None:
        assert req.finished_reason is not None and req.rid not in self.finished
        self.finished[req.rid] = req.finished_reason

    def step_ended(self, outputs) -> None:
        self.events.append("step_ended")

    def steps(self) -> list[list[str]]:
        """The events of each step() call, between step_started and step_ended."""
        text = " ".join(self.events)
        assert text.startswith("step_started") and text.endswith("step_ended")
        return [step.split() for step in text.removeprefix("step_started ").removesuffix(" step_ended")
                .split(" step_ended step_started ")]


def _engine(tiny_llama_dir: str, overlap: bool, **scheduler) -> Engine:
    return Engine({"model": {"path": tiny_llama_dir}, "cache": {"max_total_tokens": 1024},
                   "scheduler": {"disable_overlap": not overlap, **scheduler}})


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_observers_hear_every_step_in_order_and_change_nothing(tiny_llama_dir, overlap) -> None:
    reference = _engine(tiny_llama_dir, overlap).generate(input_ids=PROMPTS, sampling_params=PARAMS)
    engine = _engine(tiny_llama_dir, overlap)
    log = EventLog()
    engine.scheduler.add_observer(log)
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]

    steps = log.steps()
    assert steps[0] == ["requests_admitted", *LAUNCH, *(SAMPLE if overlap else SAMPLE + READ)]
    launching = steps[1:-1] if overlap else steps[1:]
    assert all(step == [*LAUNCH, *(READ + SAMPLE if overlap else SAMPLE + READ)] for step in launching), steps
    if overlap:  # the last call only reads the step in flight
        assert steps[-1] == ["no_batch", *READ]
    # One launch per step that built a batch (greedy decode of 5 tokens: one prefill, then 4 decodes), none failed.
    assert len(log.launched) == 5 and all(step is not None for step in log.launched)
    assert sorted(log.admitted) == sorted(log.finished) and len(log.finished) == len(PROMPTS)
    assert set(log.finished.values()) == {"length"}
    engine.scheduler.remove_observer(log)
    engine.generate(input_ids=PROMPTS[:1], sampling_params=PARAMS[:1])
    assert len(log.steps()) == len(steps)  # removed: no longer told
    assert_kv_accounted(engine)


def test_an_abort_and_a_device_oom_are_told_too(tiny_llama_dir) -> None:
    engine = _engine(tiny_llama_dir, overlap=True, chunked_prefill_size=64)
    scheduler = engine.scheduler
    log = EventLog()
    scheduler.add_observer(log)
    runner = scheduler.worker.runner
    forward = runner.forward

    def two_at_most(forward_batch):
        if forward_batch.batch_size > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return forward(forward_batch)

    runner.forward = two_at_most
    for i, prompt in enumerate(PROMPTS):
        scheduler.add_request(Req(rid=f"r{i}", origin_input_ids=prompt, sampling_params=PARAMS[1]))
    scheduler.step()  # three prompts in one batch: out of memory, undone, retried with two
    assert log.launched[0] is None and scheduler.kv_stats()["oom_retries"] == 1
    assert log.admitted[:3] == ["r0", "r1", "r2"]  # admitted, undone, then admitted again
    scheduler.abort_request("r1")
    assert log.finished == {"r1": "abort"}
    while scheduler.has_work():
        scheduler.step()
    assert log.finished == {"r1": "abort", "r0": "length", "r2": "length"}
    assert_kv_accounted(engine)


class PrefillTokens(StepObserver):
    """The example of docs/scheduling.md, "Step observers"."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.retracted = 0

    def batch_built(self, batch) -> None:
        if batch is not None:
            self.prompt_tokens += sum(e.extend_len for e in batch.entries if not e.input_on_device)

    def request_retracted(self, req) -> None:
        self.retracted += 1


def test_the_documented_example_counts_the_prompt_tokens_computed(tiny_llama_dir) -> None:
    engine = _engine(tiny_llama_dir, overlap=True)
    counter = PrefillTokens()
    engine.scheduler.add_observer(counter)
    engine.generate(input_ids=PROMPTS, sampling_params=PARAMS)
    assert counter.prompt_tokens == sum(len(p) for p in PROMPTS) and counter.retracted == 0
