"""Recording the batches a scheduler launches (shared by the batching tests; imported by name, see conftest.py)."""

from __future__ import annotations

from typing import Any, Callable

from treadle.core.scheduling.observers import StepObserver


class BatchLog(StepObserver):
    """A step observer that keeps ``describe(batch)`` of every batch whose forward is launched."""

    def __init__(self, describe: Callable[[Any], Any]) -> None:
        self.describe = describe
        self.log: list[Any] = []

    def forward_launching(self, batch: Any) -> None:
        self.log.append(self.describe(batch))


def record_batches(engine: Any, describe: Callable[[Any], Any]) -> list[Any]:
    """Observes the engine scheduler's steps; the returned list gets ``describe(batch)`` per launch.

    Under tensor parallelism it observes rank 0's own scheduler: the leader that wraps it only delegates to it."""
    from treadle.core.distributed.tensor_parallel import LeaderScheduler

    scheduler = engine.scheduler.scheduler if isinstance(engine.scheduler, LeaderScheduler) else engine.scheduler
    observer = BatchLog(describe)
    scheduler.add_observer(observer)
    return observer.log


def generate_logged(model_dir: str, scheduler: dict[str, Any], prompts: list[list[int]], params: list[Any],
                    describe: Callable[[Any], Any]) -> tuple[list[Any], list[Any], Any]:
    """A fresh small engine (2048 KV slots, ``scheduler`` settings) generates ``prompts``: (token ids and finish
    reason per prompt, ``describe(batch)`` per launched batch, the engine)."""
    from treadle import Engine

    engine = Engine({"model": {"path": model_dir}, "cache": {"max_total_tokens": 2048}, "scheduler": scheduler})
    log = record_batches(engine, describe)
    outputs = engine.generate(input_ids=prompts, sampling_params=params)
    return [(o.token_ids, o.finish_reason) for o in outputs], log, engine
