"""The front-end bench's stand-in scheduler and its per-hop timing."""

from __future__ import annotations

from treadle.bench.front_end import StandInScheduler, wire_costs
from treadle.core.config import load_config
from treadle.core.request import FinishReason, Req, SamplingParams


def test_the_stand_in_gives_each_running_request_a_token_a_step_up_to_its_length() -> None:
    config = load_config(None, overrides=["scheduler.max_running_requests=2"])
    scheduler = StandInScheduler(config, step_s=0.0)
    for rid, length in (("a", 1), ("b", 2), ("c", 1)):
        params = SamplingParams(max_new_tokens=length)
        scheduler.add_request(Req(rid=rid, origin_input_ids=[1, 2], sampling_params=params))
    steps = []
    while scheduler.has_work():
        steps.append([(out.rid, out.completion_tokens, out.finished_reason) for out in scheduler.step()])
    assert steps == [[("a", 1, FinishReason.LENGTH), ("b", 1, None)],  # two at once: c waits
                     [("b", 2, FinishReason.LENGTH), ("c", 1, FinishReason.LENGTH)]]


def test_wire_costs_times_both_forms_at_every_hop() -> None:
    costs = wire_costs(outputs_per_step=4, repeats=1)
    assert set(costs) == {"objects", "columns"}
    assert all(set(hops) == {"scheduler", "detokenizer", "http worker"} and min(hops.values()) > 0
               for hops in costs.values())
