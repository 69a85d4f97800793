"""An example treadle plugin: admits the shortest prompts first (``scheduler.policy: shortest-prompt-first``)."""

from __future__ import annotations

from treadle.core.hookspecs import hookimpl
from treadle.core.scheduling.policy import SchedulePolicy


class ShortestPromptFirst(SchedulePolicy):
    """Admit the requests with the fewest prompt tokens first; ties keep arrival order."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def order(self, waiting, tree_cache):
        return sorted(waiting, key=lambda req: (len(req.origin_input_ids), req.arrival))


@hookimpl
def treadle_register_schedule_policies(register):
    register("shortest-prompt-first", ShortestPromptFirst)
