"""The torch.profiler summaries of ``treadle bench one-batch``: kernels by category, GPU busy time against wall
time, and the host time spent in the worker's methods, for bs=1 decode steps and for prefills."""

from __future__ import annotations

import time
from typing import Any

import torch

from treadle.bench.one_batch_steps import decode_step, place_batch, prefill
from treadle.bench.roofline import synchronize
from treadle.bench.step_meter import kernel_category

# A prefill of this many tokens: the size of the small prefill steps in the offline runs (docs/lab/benchmarks-history.md).
PROFILE_PREFILL_TOKENS = 300
# A gap between two GPU kernels shorter than this is the hand-over inside a step (a replayed graph's kernels follow
# one another within microseconds); longer ones are the host's time between steps (a synchronize, the next launch).
STEP_GAP_US = 50.0


def profile_decode(worker: Any, label: str, prompt: torch.Tensor, steps: int = 20) -> dict[str, Any]:
    """torch.profiler over ``steps`` decode steps of the ``prompt`` rows [bs, length]: top kernels and GPU busy
    time per step."""
    bs, input_len = prompt.shape
    batch = place_batch(worker, bs, input_len + steps + 2)
    next_ids = prefill(worker, batch, prompt)
    next_ids = decode_step(worker, batch, next_ids, input_len + 1)
    state = {"next_ids": next_ids, "step": 0}

    def step() -> None:
        state["next_ids"] = decode_step(worker, batch, state["next_ids"], input_len + state["step"] + 2)
        state["step"] += 1

    # The keys keep their names from before the worker held the graphs, so results stay comparable.
    host = {"runner.forward (host, until the graph is launched)": (worker, "forward"),
            "attention backend replay metadata (host)": (worker.runner.attn_backend,
                                                         "init_forward_metadata_replay_cuda_graph")}
    return _profile_steps(worker, f"treadle {label}", f"bs={bs} decode", step, steps, host)


def profile_prefill(worker: Any, label: str, prompt_len: int = PROFILE_PREFILL_TOKENS, steps: int = 5,
                    prompts: int = 1) -> dict[str, Any]:
    """torch.profiler over ``steps`` prefills of ``prompts`` prompts of ``prompt_len`` tokens each (by default
    one: the small prefill steps that stall a large decode batch; 7 x 292 is a full 2048-token chunk of the offline
    workload): GPU busy time against wall time, and the host time to launch them."""
    prompt = torch.randint(100, 1000, (prompts, prompt_len))
    batch = place_batch(worker, prompts, prompt_len + 1)
    prefill(worker, batch, prompt)  # compiles whatever this length needs

    def step() -> None:
        prefill(worker, batch, prompt)

    what = f"prefill of {prompt_len} tokens" if prompts == 1 else f"prefill of {prompts} x {prompt_len} tokens"
    host = {"runner.forward (host: builds metadata and launches every kernel)": (worker, "forward")}
    return _profile_steps(worker, f"treadle {label}", what, step, steps, host)


def _profile_steps(worker: Any, system: str, what: str, step: Any, steps: int,
                   host: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    """Run ``step`` ``steps`` times (each followed by a synchronize) under torch.profiler, with the host time
    spent in each ``host`` method (an instance attribute wraps it for the window)."""
    from torch.profiler import ProfilerActivity, profile

    host_us = {key: 0.0 for key in host}
    for key, (obj, name) in host.items():
        setattr(obj, name, _host_timer(getattr(obj, name), host_us, key))
    synchronize(worker.info.device)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
                synchronize(worker.info.device)
            wall = (time.perf_counter() - start) / steps
    finally:
        for obj, name in host.values():
            delattr(obj, name)  # drop the instance attribute: the class method shows through again
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        if device_us and event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append({"name": event.key[:90], "calls_per_step": event.count / steps,
                            "us_per_step": device_us / steps, "category": kernel_category(event.key)})
    kernels.sort(key=lambda k: -k["us_per_step"])
    busy = sum(k["us_per_step"] for k in kernels)
    union_us, idle_us, idle_before = gpu_timeline([(e.time_range.start, e.time_range.end, e.name[:90])
                                                   for e in prof.events()
                                                   if e.device_type == torch.autograd.DeviceType.CUDA])
    categories: dict[str, float] = {}
    for k in kernels:
        categories[k["category"]] = categories.get(k["category"], 0.0) + k["us_per_step"]
    return {
        "system": system, "what": what, "steps": steps,
        "wall_us_per_step_profiled": wall * 1e6, "gpu_busy_us_per_step": busy,
        "kernels_per_step": sum(k["calls_per_step"] for k in kernels),
        # With programmatic dependent launch kernels overlap (the next one starts, then waits): the sum above counts
        # the overlap twice, the union once; idle is the GPU's time with no kernel between two of one step's.
        "gpu_union_us_per_step": union_us / steps, "gpu_idle_in_step_us_per_step": idle_us / steps,
        # Which kernels the GPU waited for (the idle time just before each kernel, summed by name).
        "gpu_idle_before_us_per_step": {name: us / steps for name, us in sorted(
            idle_before.items(), key=lambda kv: -kv[1])[:10]},
        "by_category_us_per_step": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
        "host_us_per_step": {key: us / steps for key, us in host_us.items()},
        "top_kernels": kernels[:40],
    }


def gpu_timeline(intervals: list[tuple[float, float, str]], step_gap_us: float = STEP_GAP_US
                 ) -> tuple[float, float, dict[str, float]]:
    """``(busy, idle, idle before each kernel name)`` microseconds of the GPU's kernels ``intervals``
    [(start, end, name)]: the time at least one ran, and the gaps between them shorter than ``step_gap_us`` (inside
    steps; longer ones are between steps), also summed by the name of the kernel that ends each gap."""
    busy = idle = 0.0
    before: dict[str, float] = {}
    reach = None  # the end of the kernels so far
    for start, end, name in sorted(intervals):
        if reach is None or start >= reach:
            if reach is not None and start - reach < step_gap_us:
                idle += start - reach
                before[name] = before.get(name, 0.0) + start - reach
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return busy, idle, before


def _host_timer(function: Any, totals: dict[str, float], key: str) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            totals[key] += (time.perf_counter() - start) * 1e6

    return timed
