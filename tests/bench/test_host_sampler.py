"""HostSampler finds the function the main thread is busy in, and leaves waits for the device out."""

from __future__ import annotations

import time

from treadle.bench.host_sampler import HostSampler, _waiting


def _busy_loop(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(100))


def test_the_busy_function_dominates_its_window() -> None:
    sampler = HostSampler(interval_s=0.001)
    sampler.start()
    start = time.perf_counter()
    _busy_loop(0.15)
    end = time.perf_counter()
    sampler.stop()
    frames = sampler.hot_frames(start, end)
    assert frames and "(_busy_loop)" in frames[0][0].split(" < ")[0], frames
    assert 50 < frames[0][1] <= 200  # ms of host work attributed to it
    assert sampler.hot_frames(end + 10, end + 20) == []


def test_waiting_for_the_device_is_not_host_work() -> None:
    assert _waiting(("overlap.py:65(wait)", "scheduler_output.py:26(_process)"))
    assert _waiting(("streams.py:245(synchronize)",))
    assert not _waiting(("scheduler_output.py:26(_process)", "scheduler.py:260(_settle)"))
