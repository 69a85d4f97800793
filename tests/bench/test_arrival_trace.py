"""``treadle bench arrival-trace`` on the CPU: Poisson arrivals into one scheduler, every token's gap counted,
steps split by kind, the host profile of prefill launches."""

from __future__ import annotations

import json

from treadle.bench import arrival_trace


def test_arrival_trace_counts_every_gap_and_splits_steps_by_kind(tiny_llama_dir, tmp_path, capsys) -> None:
    out = tmp_path / "trace.json"
    code = arrival_trace.main([
        "--set", f"model.path={tiny_llama_dir}", "--device", "cpu", "--request-rate", "200", "--num-prompts", "12",
        "--input-len", "4:40", "--output-len", "3:12", "--set", "scheduler.latency_chunk_size=8",
        "--slow-gap-ms", "0", "--show-slow", "3", "--cprofile-steps", "2", "--output", str(out),
    ])
    assert code == 0
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "TTFT ms" in printed and "| DECODE |" in printed
    kinds = report["per_step_kind"]
    assert kinds["DECODE"]["steps"] > 0 and kinds["EXTEND"]["steps"] > 0
    # A trickle beside running decodes rides in them: latency chunks of at most 8 prompt tokens.
    assert kinds["MIXED"]["steps"] > 0
    workload = report["workload"]
    assert workload["num_requests"] == 12
    assert report["gaps"] == workload["output_tokens"] - 12  # one gap between each two tokens of a request
    # Every gap is over 0 ms, so every step that delivered a later token is a slow-gap step.
    assert report["slow_gap_steps"] >= 3 and len(report["slow_gap_windows"]) == 3
    # Printed for a person: the overlapping windows' steps once each, and no GPU columns on the CPU.
    step_rows = [line.split("|")[1].strip() for line in printed.splitlines() if line.startswith("| ") and
                 line.split("|")[1].strip().isdigit()]
    assert len(step_rows) == len(set(step_rows)) and step_rows.count(step_rows[-1]) == 1
    assert printed.count(" slow |") == 3
    assert "nan" not in printed and "GPU ms" not in printed
    assert report["itl_ms"]["share_over_0ms"] == 1.0
    assert "forward_hidden" in report["cprofile_prefill_launch"] or "forward" in report["cprofile_prefill_launch"]
    assert report["syncs"] == {}


def test_step_trace_of_a_loop_it_does_not_drive_is_dumped_per_step_kind(tiny_llama_dir, tmp_path) -> None:
    # What the server's scheduler process does with TREADLE_STEP_TRACE set.
    from treadle import Engine, SamplingParams

    engine = Engine({"model": {"path": tiny_llama_dir, "device": "cpu"}})
    trace = arrival_trace.StepTrace(engine.scheduler)
    trace.install()
    engine.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params=SamplingParams(max_new_tokens=4, ignore_eos=True))
    path = tmp_path / "steps.json"
    trace.dump(str(path))
    dumped = json.loads(path.read_text())
    assert dumped["steps"] == len(trace.steps) >= 4
    assert dumped["per_step_kind"]["EXTEND"]["steps"] == 1 and dumped["per_step_kind"]["DECODE"]["steps"] >= 3
    for name in ("build", "forward", "settle", "sampling"):
        assert dumped["per_step_kind"]["DECODE"][f"{name}_mean_ms"] > 0
    assert "step" not in vars(engine.scheduler) and "_settle" not in vars(engine.scheduler)  # nothing patched
    engine.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert len(trace.steps) == dumped["steps"]  # dump stopped observing
