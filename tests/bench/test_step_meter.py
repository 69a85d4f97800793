"""StepMeter's GPU-time arithmetic (CUDA events replaced by timestamps, so it runs on the CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from treadle.bench.step_meter import StepMeter


class _Event:
    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, other: "_Event") -> float:
        return other.ms - self.ms


def test_busy_fractions_and_time_per_step_kind_from_the_step_events() -> None:
    scheduler = SimpleNamespace(worker=SimpleNamespace(info=SimpleNamespace(device=SimpleNamespace(type="cpu"))))
    meter = StepMeter(scheduler)
    meter._t0, meter._t1 = _Event(0), _Event(13)
    meter.steps = [  # idle 1 ms before each of the first two steps and 1 ms at the end; none before the third
        {"mode": "DECODE", "bs": 4, "tokens": 4, "waiting": 9, "running": 4, "free_kv": 50, "host": 0.0, "gc_ms": 0.0,
         "wait_ms": 0.0, "settle_ms": 0.0, "launch_ms": 0.1, "start": _Event(1), "end": _Event(3)},
        {"mode": "EXTEND", "bs": 1, "tokens": 300, "waiting": 9, "running": 4, "free_kv": 50, "host": 0.002, "gc_ms": 0.5,
         "wait_ms": 0.25, "settle_ms": 1.0, "launch_ms": 3.0, "start": _Event(4), "end": _Event(10)},
        {"mode": "DECODE", "bs": 200, "tokens": 200, "waiting": 8, "running": 5, "free_kv": 40, "host": 0.0065, "gc_ms": 0.0,
         "wait_ms": 4.0, "settle_ms": 4.25, "launch_ms": 0.1, "start": _Event(10), "end": _Event(12)},
    ]
    busy = meter._busy()
    assert busy["gpu_idle_ms"] == 3 and busy["gpu_busy_fraction"] == pytest.approx(10 / 13)
    assert busy["gpu_busy_fraction_decode"] == pytest.approx(1 - 1 / 5)  # 1 ms idle in 5 ms of decode spans
    decode, extend = busy["by_mode"]["DECODE"], busy["by_mode"]["EXTEND"]
    assert (decode["steps"], decode["tokens"], decode["gpu_ms"], decode["idle_before_ms"]) == (2, 204, 4, 1)
    assert (decode["small_steps"], decode["small_gpu_ms"]) == (1, 2)  # the batch of 4; 200 is not small
    assert (extend["steps"], extend["gpu_ms"], extend["idle_before_ms"], extend["small_steps"]) == (1, 6, 1, 1)
    assert busy["by_size"]["DECODE"] == [  # the batch of 4 in the first group, 200 in 192..255
        {"min_size": 1, "steps": 1, "tokens": 4, "gpu_ms": 2},
        {"min_size": 192, "steps": 1, "tokens": 200, "gpu_ms": 2},
    ]
    assert busy["by_size"]["EXTEND"] == [{"min_size": 256, "steps": 1, "tokens": 300, "gpu_ms": 6}]
    # host ms between launches (perf_counter seconds apart), the GC, wait and settle ms before each launch,
    # and each step's own launch ms
    assert meter._trace()["steps"] == [["D", 4, 4, 9, 4, 50, 2, 1, 0, 0, 0, 0, 0.1],
                                       ["E", 1, 300, 9, 4, 50, 6, 1, 2, 0.5, 0.25, 1.0, 3.0],
                                       ["D", 200, 200, 8, 5, 40, 2, 0, 4.5, 0, 4.0, 4.25, 0.1]]


def test_step_trace_times_garbage_collection_and_settling_between_launches(tiny_llama_dir) -> None:
    import gc

    from treadle import Engine, SamplingParams

    engine = Engine({"model": {"path": tiny_llama_dir, "device": "cpu"}})
    scheduler = engine.scheduler
    meter = StepMeter(scheduler, step_trace=True)
    meter.install()
    try:
        assert meter._on_gc in gc.callbacks
        gc.collect()  # before the first launch: counted in the first step's gc_ms
        engine.generate(input_ids=[[5, 6, 7], [8, 9]],
                        sampling_params=SamplingParams(max_new_tokens=4, ignore_eos=True))
    finally:
        meter.uninstall()
    steps = meter.steps
    assert [s["mode"] for s in steps] == ["EXTEND", "DECODE", "DECODE", "DECODE"]
    assert [s["tokens"] for s in steps] == [5, 2, 2, 2] and all(s["end"] is not None for s in steps)
    assert steps[0]["gc_ms"] > 0
    # Under overlap step k is read after step k+1 is launched, so the host time before the launch of step k+2
    # holds it; reading includes waiting for its tokens. Nothing was read before the first two launches.
    assert [s["settle_ms"] for s in steps[:2]] == [0, 0]
    assert all(s["settle_ms"] > 0 and s["settle_ms"] >= s["wait_ms"] > 0 for s in steps[2:])
    assert meter._on_gc not in gc.callbacks and "_settle" not in vars(scheduler)
    engine.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert meter.steps == steps and len(steps) == 4  # no longer observing


def test_the_progress_line_names_the_host_frames_behind_gpu_stalls() -> None:
    from treadle.bench.offline_results import _stall_lines

    stalls = [{"step": 4, "idle_ms": 12.0, "host_ms": 40.0,
               "frames": [["linear.py:87(apply) < layers.py:1(forward)", 20.0], ["sampler.py:9(__call__)", 5.0]]},
              {"step": 9, "idle_ms": 3.0, "host_ms": 30.0, "frames": [["sampler.py:9(__call__)", 18.0]]}]
    line = _stall_lines(stalls)
    assert "2 steps, 0.01 s" in line
    assert line.index("sampler.py:9(__call__) 23 ms") < line.index("linear.py:87(apply) 20 ms")
    assert _stall_lines([]) == ""


def test_under_tensor_parallelism_the_meter_hooks_rank_zeros_own_scheduler() -> None:
    """The Engine's scheduler at tp > 1 is a LeaderScheduler; hooks set on it would never run (the offline bench
    then reported 0% GPU busy at tp=2), so the meter observes the scheduler it wraps."""
    from treadle.core.distributed.tensor_parallel import LeaderScheduler

    observers: list = []
    local = SimpleNamespace(worker=SimpleNamespace(info=SimpleNamespace(device=SimpleNamespace(type="cpu"))),
                            add_observer=observers.append, remove_observer=observers.remove)
    leader = LeaderScheduler(local, ranks=None, watcher=None)
    meter = StepMeter(leader)
    meter.install()
    assert meter.scheduler is local and observers == [meter] and "add_observer" not in vars(leader)
    meter.uninstall()
    assert observers == []
