"""The data-parallel balance simulation (bench/dp_balance.py): the work it reports per replica adds up, and it shows
what the policies differ in (work spread on the random workload, cache hits on the shared-prefix one)."""

from __future__ import annotations

import json

from treadle.bench import dp_balance
from treadle.bench.workloads import build_workload


def test_work_per_replica_adds_up_and_least_work_spreads_it_more_evenly() -> None:
    workload = build_workload("random", 200, range(32_000), input_len=(16, 600), output_len=(16, 400), seed=0)
    runs = {policy: dp_balance.simulate(workload, policy, 4, cache_tokens=100_000)
            for policy in ("shortest_queue", "least_work")}
    for run in runs.values():
        rows = run["per_replica"]
        assert sum(row["requests"] for row in rows) == 200
        assert run["total_work"] == workload.input_tokens + workload.output_tokens  # random prompts share nothing
    assert runs["least_work"]["max_over_mean"] < 1.015
    assert runs["shortest_queue"]["max_over_mean"] > 1.025


def test_the_cli_reports_prefix_hits_only_where_routing_follows_the_prefix(tmp_path, capsys) -> None:
    output = tmp_path / "dp.json"
    dp_balance.main(["--workload", "shared-prefix", "--num-prompts", "90", "--num-prefixes", "9", "--prefix-len", "64",
                     "--output-len", "4:8", "--replicas", "2", "--policies", "round_robin", "prefix_aware",
                     "--cache-tokens", "640", "--orders", "3", "--output", str(output)])
    runs = {run["policy"]: run for run in json.loads(output.read_text())["runs"]}
    # 9 prompts (odd) cycled: round robin sends each to both replicas, whose 640-token caches then thrash.
    assert runs["round_robin"]["cache_hit_rate"] == 0.0
    assert runs["prefix_aware"]["cache_hit_rate"] > 0.5
    assert runs["round_robin"]["arrival_orders"]["orders"] == 3
    assert "prefix_aware" in capsys.readouterr().out
