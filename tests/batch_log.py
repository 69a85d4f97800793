"""Recording the batches a scheduler launches (shared by the batching tests; imported by name, see conftest.py)."""

from __future__ import annotations

from typing import Any, Callable


def record_batches(engine: Any, describe: Callable[[Any], Any]) -> list[Any]:
    """Wraps the engine scheduler's ``_launch_forward``; the returned list gets ``describe(batch)`` per launch.

    Under tensor parallelism it wraps rank 0's own scheduler: the leader that wraps it only delegates to it."""
    from treadle.core.distributed.tensor_parallel import LeaderScheduler

    log: list[Any] = []
    scheduler = engine.scheduler.scheduler if isinstance(engine.scheduler, LeaderScheduler) else engine.scheduler
    launch = scheduler._launch_forward

    def recording_launch(batch: Any) -> Any:
        log.append(describe(batch))
        return launch(batch)

    scheduler._launch_forward = recording_launch
    return log


def generate_logged(model_dir: str, scheduler: dict[str, Any], prompts: list[list[int]], params: list[Any],
                    describe: Callable[[Any], Any]) -> tuple[list[Any], list[Any], Any]:
    """A fresh small engine (2048 KV slots, ``scheduler`` settings) generates ``prompts``: (token ids and finish
    reason per prompt, ``describe(batch)`` per launched batch, the engine)."""
    from treadle import Engine

    engine = Engine({"model": {"path": model_dir}, "cache": {"max_total_tokens": 2048}, "scheduler": scheduler})
    log = record_batches(engine, describe)
    outputs = engine.generate(input_ids=prompts, sampling_params=params)
    return [(o.token_ids, o.finish_reason) for o in outputs], log, engine
