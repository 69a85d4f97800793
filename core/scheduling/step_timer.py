"""StepTimer: a step observer that times where each step's host time went, and its GPU span.

Per step it keeps the batch's kind and size and the host seconds spent building it (``build``), launching its
forward (``forward``), reading the step before (``settle``: waiting for its tokens and processing them; for a
verify step the wait comes before the build and is not counted in ``build``) and launching its sampling
(``sampling``). On CUDA it records an event before the forward and one after the
sampling; after one synchronize, :meth:`resolve_gpu_times` turns them into the step's GPU span and the GPU's
idle gap before it. Events never synchronize the device.

The server's ``TREADLE_STEP_TRACE`` diagnostic records one (docs/server.md) and ``treadle bench arrival-trace``
builds on it.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from treadle.core.scheduling.observers import StepObserver

# The host phases of a step, in seconds, as StepTimer names them (the keys of each step and of step_kinds).
HOST_PHASES = ("build", "forward", "settle", "sampling")


class StepTimer(StepObserver):
    """Times every step of the scheduler it is registered with (``scheduler.add_observer(timer)``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.steps: list[dict[str, Any]] = []  # one dict a step; its keys: see the module docstring
        self.current: dict[str, Any] = {}
        self._phase_start = 0.0
        self._settle_start = 0.0

    # ------------------------------------------------------------------ step events

    def step_started(self) -> None:
        self.current = {"host_start": time.perf_counter()}

    def batch_built(self, batch: Any) -> None:
        self._add("build", self.current["host_start"])
        # A step read before the batch was built (a verify step waited for, a settle to make room) is settle time.
        self.current["build"] -= self.current.get("settle", 0.0)

    def forward_launching(self, batch: Any) -> None:
        self.current.update(mode=batch.forward_mode.name, bs=len(batch.entries),
                            tokens=sum(e.extend_len for e in batch.entries), gpu_start=self._event())
        self._phase_start = time.perf_counter()

    def forward_launched(self, batch: Any, step: Any) -> None:
        self._add("forward", self._phase_start)

    def results_waiting(self, step: Any) -> None:
        self._settle_start = time.perf_counter()

    def results_arrived(self, step: Any) -> None:
        # The wait and the processing are timed apart: a verify step's wait comes before the batch is built.
        self._add("settle", self._settle_start)
        self._settle_start = time.perf_counter()

    def step_settled(self, step: Any) -> None:
        self._add("settle", self._settle_start)

    def sampling_launching(self, step: Any) -> None:
        self._phase_start = time.perf_counter()

    def sampling_launched(self, step: Any) -> None:
        self._add("sampling", self._phase_start)
        self.current["gpu_end"] = self._event()

    def step_ended(self, outputs: list[Any]) -> None:
        self.current["host_end"] = time.perf_counter()
        self.steps.append(self.current)

    def _add(self, phase: str, since: float) -> None:
        self.current[phase] = self.current.get(phase, 0.0) + time.perf_counter() - since

    def _event(self) -> Any:
        if not self.on_cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    # ------------------------------------------------------------------ results

    def resolve_gpu_times(self) -> None:
        """After a synchronize: each step's GPU span and the GPU idle gap before it, in seconds."""
        previous_end = None
        for step in self.steps:
            start, end = step.pop("gpu_start", None), step.pop("gpu_end", None)
            if start is None or end is None:
                continue
            step["gpu"] = start.elapsed_time(end) / 1e3
            step["gpu_idle_before"] = previous_end.elapsed_time(start) / 1e3 if previous_end is not None else 0.0
            previous_end = end

    def summary(self) -> dict[str, Any]:
        """Waits for the device, then: the step count, GPU seconds busy and idle between steps, the busy share,
        and the split per step kind (:func:`step_kinds`)."""
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
        self.resolve_gpu_times()
        gpu = sum(s.get("gpu", 0.0) for s in self.steps)
        idle = sum(s.get("gpu_idle_before", 0.0) for s in self.steps)
        return {"steps": len(self.steps), "gpu_s": gpu, "gpu_idle_between_steps_s": idle,
                "gpu_busy_share": gpu / (gpu + idle) if gpu + idle else None,
                "per_step_kind": step_kinds(self.steps)}

    def dump(self, path: str) -> None:
        """Write :meth:`summary` to ``path`` as JSON."""
        Path(path).write_text(json.dumps(self.summary(), indent=1))


def step_kinds(steps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per step kind: count, mean tokens, and mean / p90 milliseconds of every timed phase and of the GPU span
    and the idle gap before it."""
    kinds: dict[str, dict[str, float]] = {}
    for mode in sorted({s.get("mode", "NONE") for s in steps}):
        chosen = [s for s in steps if s.get("mode", "NONE") == mode]
        kinds[mode] = {"steps": len(chosen), "mean_tokens": statistics.fmean(s.get("tokens", 0) for s in chosen)}
        for name in (*HOST_PHASES, "gpu", "gpu_idle_before"):
            values = [s[name] for s in chosen if name in s]
            if values:
                kinds[mode][f"{name}_mean_ms"] = 1e3 * statistics.fmean(values)
                kinds[mode][f"{name}_p90_ms"] = 1e3 * percentile(values, 0.9)
    return kinds


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (the element at that rank; NaN when empty)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")
