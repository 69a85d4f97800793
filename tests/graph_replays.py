"""Counting a CUDA-graph runner's replays (shared by the GPU graph tests; imported by name, see conftest.py)."""

from __future__ import annotations

from typing import Any


class ReplayCounter:
    """Wraps ``runner.replay`` to count its calls in ``count``; a None runner counts nothing."""

    def __init__(self, runner: Any) -> None:
        self.count = 0
        if runner is not None:
            replay = runner.replay

            def counting_replay(forward_batch: Any) -> Any:
                self.count += 1
                return replay(forward_batch)

            runner.replay = counting_replay
