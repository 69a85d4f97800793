"""Step observers on CUDA: the step timer and the bench's step meter record real GPU spans from their events,
and decode steps observed by both still never synchronize the device."""

from __future__ import annotations

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.bench.step_meter import StepMeter
from treadle.core.request import Req
from treadle.core.scheduling.step_timer import StepTimer
from treadle.testing.engine import assert_kv_accounted

pytestmark = pytest.mark.gpu


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 300, (count,), generator=generator).tolist()
    return [torch.randint(10, 8000, (n,), generator=generator).tolist() for n in lengths]


def test_observed_decode_steps_do_not_synchronize_and_the_meters_see_the_gpu(real_shape_llama_dir, engine_config):
    engine = Engine(engine_config(real_shape_llama_dir, "triton", "bfloat16"))
    scheduler = engine.scheduler
    timer = StepTimer(torch.device("cuda"))
    meter = StepMeter(scheduler, step_trace=True)
    scheduler.add_observer(timer)
    meter.install()
    try:
        torch.cuda.synchronize()
        meter.begin()
        for i, prompt in enumerate(_prompts(8, seed=5)):
            scheduler.add_request(Req(rid=f"r{i}", origin_input_ids=prompt, sampling_params=SamplingParams(
                max_new_tokens=40, temperature=0.0, ignore_eos=True)))
        for _ in range(6):  # prefills, then a few decode steps
            scheduler.step()
        assert not scheduler.waiting and scheduler.chunked_req is None and len(scheduler.running) == 8
        torch.cuda.set_sync_debug_mode("error")  # the observers' events must not synchronize either
        try:
            for _ in range(10):
                scheduler.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        while scheduler.has_work():
            scheduler.step()
        meter.end()
        torch.cuda.synchronize()
    finally:
        meter.uninstall()
        scheduler.remove_observer(timer)
    summary = meter.summary()
    assert 0 < summary["gpu_busy_fraction"] <= 1 and summary["peak_decode_batch_size"] == 8
    assert summary["by_mode"]["DECODE"]["gpu_ms"] > 0 and summary["by_mode"]["DECODE"]["steps"] >= 39
    assert len(summary["step_trace"]["steps"]) == summary["steps"]
    split = timer.summary()
    assert split["steps"] >= summary["steps"] and 0 < split["gpu_busy_share"] <= 1
    decode = split["per_step_kind"]["DECODE"]
    assert decode["gpu_mean_ms"] > 0 and decode["forward_mean_ms"] > 0 and decode["settle_mean_ms"] > 0
    assert_kv_accounted(engine)
    engine.shutdown()
