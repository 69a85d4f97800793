"""The installed third-party example package is discovered and selectable from YAML, with no change to core."""

from __future__ import annotations

from treadle import Engine, SamplingParams
from treadle.core.registry import build_registry
from treadle.core.request import Req
from treadle.testing import check_schedule_policy
from treadle.testing.engine import assert_kv_accounted


def test_example_policy_is_discovered_through_its_entry_point():
    registry = build_registry()
    assert registry.table()["schedule_policies"]["shortest-prompt-first"] == "treadle-plugin-example"
    check_schedule_policy(registry.get("schedule_policies", "shortest-prompt-first"))


def test_example_policy_selected_from_yaml_runs_the_engine(tmp_path, tiny_llama_dir):
    path = tmp_path / "server.yaml"
    path.write_text(
        f"model:\n  path: {tiny_llama_dir}\n"
        "cache:\n  max_total_tokens: 512\n"
        "scheduler:\n  policy: shortest-prompt-first\n  max_running_requests: 1\n"
    )
    engine = Engine(str(path))
    assert type(engine.scheduler.policy).__module__ == "treadle_plugin_example"
    long_prompt, short_prompt = list(range(3, 40)), [7, 8]
    scheduler = engine.scheduler
    for rid, ids in (("long", long_prompt), ("short", short_prompt)):
        scheduler.add_request(Req(rid=rid, origin_input_ids=ids,
                                  sampling_params=SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)))
    first_batch = scheduler.step()
    while not first_batch:  # with overlap scheduling a step's outputs come back one step() later
        first_batch = scheduler.step()
    assert [o.rid for o in first_batch] == ["short"]  # admitted first although it arrived second
    while scheduler.has_work():
        scheduler.step()
    assert_kv_accounted(engine)
