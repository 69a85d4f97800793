"""bench/speculative_cost.py runs end to end on tiny shapes (the 8B shapes are for the GPU): a row per method and
batch size, with the step time's ratio to plain decode and the speed-up it implies."""

from __future__ import annotations

from treadle.bench.speculative_cost import main


def test_the_cost_bench_measures_a_step_per_method(tmp_path):
    result = main(["--shape", "tiny", "--methods", "eagle3", "--batch-sizes", "1", "--prompt-len", "8",
                   "--base-tokens", "2", "--new-tokens", "6", "--output", str(tmp_path / "cost.json")])
    assert [(row["method"], row["batch_size"]) for row in result["rows"]] == [("plain", 1), ("eagle3", 1)]
    assert all(row["step_ms"] > 0 for row in result["rows"])
    assert result["rows"][0]["speedup_at"][3] == 3.0
