"""StepMeter: how busy the GPU is while a scheduler runs, the batch sizes it reached, and a profile window.

A step observer (core/scheduling/observers.py) registered with one scheduler by ``install`` and removed by
``uninstall``, so it measures whatever step loop the scheduler runs. Per step it records a CUDA event just
before the forward is launched (before the batch's device inputs are built) and one after its sampling is
launched. On the GPU's clock, the stream is idle between the end of one step's work and the start of the
next one's; the busy fraction is ``1 - idle / wall`` over the timed window (gaps inside a step, such as
kernel-launch gaps of an eager prefill, count as busy). Events cost a few microseconds each and never
synchronize.

With ``profile_steps > 0`` it also profiles one saturated stretch: the first
decode step whose batch holds at least ``profile_fill`` of the running limit
(or of every request the scheduler holds, if fewer) starts a torch.profiler window of ``profile_steps`` steps (GPU kernels by kind,
host time per step), followed by a cProfile window of as many steps (the host
functions that take the time).
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import time
from typing import Any

import torch

from treadle.bench.host_sampler import HostSampler
from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.scheduling.observers import StepObserver


class StepMeter(StepObserver):
    """GPU busy fraction, peak batch sizes and an optional profile of one scheduler's timed run."""

    def __init__(self, scheduler: Any, profile_steps: int = 0, profile_fill: float = 0.75,
                 step_trace: bool = False) -> None:
        # Under tensor parallelism the engine's scheduler is rank 0's LeaderScheduler: observe the local scheduler
        # it drives, whose steps are the ones launched here.
        self.scheduler = getattr(scheduler, "local_scheduler", scheduler)
        self.on_cuda = self.scheduler.worker.info.device.type == "cuda"
        self.profile_steps = profile_steps
        self.profile_fill = profile_fill
        self.step_trace = step_trace
        self.steps: list[dict[str, Any]] = []  # mode, sizes, scheduler queues and free KV, start/end events
        self.peak_decode_batch = 0
        self.peak_running = 0
        self._window: list[Any] = []
        self._torch_profiler: Any = None
        self._cprofile: cProfile.Profile | None = None
        self._phase = "wait"  # wait -> torch -> cprofile -> done
        self._phase_steps = 0
        self._phase_start = 0.0
        self.profile: dict[str, Any] = {}
        self._gc_started = 0.0
        self._launch_started = 0.0
        self._settle_started = 0.0
        # Host ms since the last step was launched, by kind (step_trace only): cyclic GC, waiting for a step's
        # tokens, and reading a step (the wait included).
        self._host_ms = dict.fromkeys(HOST_PHASES, 0.0)
        self.sampler = HostSampler() if step_trace else None  # where the host was before a stalled step

    # -------------------------------------------------------------------- observing

    def install(self) -> None:
        self.scheduler.add_observer(self)
        if self.step_trace:
            gc.callbacks.append(self._on_gc)
            self.sampler.start()

    def uninstall(self) -> None:
        self.scheduler.remove_observer(self)
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self.sampler is not None:
            self.sampler.stop()
        if self._phase == "torch":
            self._torch_profiler.stop()
        elif self._phase == "cprofile" and self._cprofile is not None:
            self._cprofile.disable()
        self._phase = "done"

    def begin(self) -> None:
        """Mark the start of the timed window (after a device synchronize)."""
        self._t0 = self._event()

    def end(self) -> None:
        """Mark the end of the timed window (before the final device synchronize)."""
        self._t1 = self._event()

    # -------------------------------------------------------------------- per step

    def _event(self) -> Any:
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def forward_launching(self, batch: Any) -> None:
        mode = batch.forward_mode
        bs = len(batch.entries)
        if mode == ForwardMode.DECODE:
            self.peak_decode_batch = max(self.peak_decode_batch, bs)
        scheduler = self.scheduler
        self.peak_running = max(self.peak_running, len(scheduler.running))
        self._advance_profile(mode, bs)
        self.steps.append({"mode": mode.name, "bs": bs, "tokens": bs, "waiting": len(scheduler.waiting),
                           "running": len(scheduler.running), "free_kv": scheduler.allocator.free_slots,
                           "host": time.perf_counter(), **self._host_ms, "launch_ms": 0.0,
                           "start": self._event(), "end": None})
        self._host_ms = dict.fromkeys(HOST_PHASES, 0.0)
        self._launch_started = time.perf_counter()

    def forward_launched(self, batch: Any, step: Any) -> None:
        record = self.steps[-1]
        record["launch_ms"] = (time.perf_counter() - self._launch_started) * 1e3
        if step is not None:
            record["tokens"] = step.forward_batch.num_tokens
        elif not batch.forward_mode.is_decode():
            record["tokens"] = sum(e.extend_len for e in batch.entries)

    def results_waiting(self, step: Any) -> None:
        self._settle_started = time.perf_counter()

    def results_arrived(self, step: Any) -> None:
        if self.step_trace:
            self._host_ms["wait_ms"] += (time.perf_counter() - self._settle_started) * 1e3

    def step_settled(self, step: Any) -> None:
        if self.step_trace:
            self._host_ms["settle_ms"] += (time.perf_counter() - self._settle_started) * 1e3

    def sampling_launched(self, step: Any) -> None:
        if self.steps and self.steps[-1]["end"] is None:
            self.steps[-1]["end"] = self._event()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._host_ms["gc_ms"] += (time.perf_counter() - self._gc_started) * 1e3

    # -------------------------------------------------------------------- profile

    def _advance_profile(self, mode: ForwardMode, bs: int) -> None:
        if self.profile_steps <= 0 or self._phase == "done":
            return
        if self._phase == "wait":
            limit = self.scheduler.config.scheduler.max_running_requests
            live = len(self.scheduler.running) + len(self.scheduler.waiting)
            if mode == ForwardMode.DECODE and bs >= self.profile_fill * min(limit, live):
                self._start_torch_profile(bs)
            return
        self._phase_steps += 1
        self._window.append((mode.name, bs))
        if self._phase_steps < self.profile_steps:
            return
        if self._phase == "torch":
            self._finish_torch_profile()
            self._phase, self._phase_steps, self._window = "cprofile", 0, []
            self._cprofile = cProfile.Profile()
            self._phase_start = time.perf_counter()
            self._cprofile.enable()
        else:
            assert self._cprofile is not None
            self._cprofile.disable()
            self._finish_cprofile()
            self._phase = "done"

    def _start_torch_profile(self, bs: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_cuda else [])
        self._torch_profiler = profile(activities=activities)
        self._torch_profiler.start()
        self._phase, self._phase_steps, self._window = "torch", 0, []
        self._phase_start = time.perf_counter()
        self.profile["trigger_batch_size"] = bs

    def _finish_torch_profile(self) -> None:
        if self.on_cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._phase_start
        self._torch_profiler.stop()
        steps = max(self._phase_steps, 1)
        kernels: dict[str, dict[str, float]] = {}
        host_ops: dict[str, float] = {}
        for event in self._torch_profiler.key_averages():
            device_us = getattr(event, "self_device_time_total", 0) or 0
            if device_us and event.device_type == torch.autograd.DeviceType.CUDA:
                entry = kernels.setdefault(event.key[:90], {"us_per_step": 0.0, "calls_per_step": 0.0})
                entry["us_per_step"] += device_us / steps
                entry["calls_per_step"] += event.count / steps
            elif event.self_cpu_time_total:
                host_ops[event.key[:60]] = host_ops.get(event.key[:60], 0.0) + event.self_cpu_time_total / steps
        categories: dict[str, float] = {}
        for name, entry in kernels.items():
            category = kernel_category(name)
            categories[category] = categories.get(category, 0.0) + entry["us_per_step"]
        top = sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_step"])[:15]
        self.profile["torch"] = {
            "steps": self._phase_steps,
            "batches": self._window,
            "wall_us_per_step_profiled": wall / steps * 1e6,
            "gpu_kernel_us_per_step": sum(categories.values()),
            "gpu_by_category_us_per_step": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": name, **entry} for name, entry in top],
            "top_host_ops_self_us_per_step": dict(sorted(host_ops.items(), key=lambda kv: -kv[1])[:15]),
        }

    def _finish_cprofile(self) -> None:
        wall = time.perf_counter() - self._phase_start
        steps = max(self._phase_steps, 1)
        assert self._cprofile is not None
        stats = pstats.Stats(self._cprofile, stream=io.StringIO())
        rows = []
        for (filename, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
            short = filename.rsplit("treadle/", 1)[-1] if "treadle/" in filename else filename.rsplit("/", 1)[-1]
            rows.append({"function": f"{short}:{line}({name})", "calls_per_step": calls / steps,
                         "self_us_per_step": tottime / steps * 1e6, "cum_us_per_step": cumtime / steps * 1e6})
        self.profile["cprofile"] = {
            "steps": self._phase_steps,
            "batches": self._window,
            "wall_us_per_step_profiled": wall / steps * 1e6,
            "top_cumulative": sorted(rows, key=lambda r: -r["cum_us_per_step"])[:30],
            "top_self": sorted(rows, key=lambda r: -r["self_us_per_step"])[:25],
        }

    # -------------------------------------------------------------------- results

    def summary(self) -> dict[str, Any]:
        """Busy fractions (whole run and decode steps), peak sizes, step counts, and the profile."""
        result: dict[str, Any] = {
            "steps": len(self.steps),
            "decode_steps": sum(1 for s in self.steps if s["mode"] == "DECODE"),
            "peak_decode_batch_size": self.peak_decode_batch,
            "peak_running_requests": self.peak_running,
            "mean_decode_batch_size": _mean([s["bs"] for s in self.steps if s["mode"] == "DECODE"]),
        }
        if self.on_cuda and self.steps and hasattr(self, "_t0") and hasattr(self, "_t1"):
            torch.cuda.synchronize()
            result.update(self._busy())
            if self.step_trace:
                result["step_trace"] = self._trace()
        if self.profile:
            result["profile"] = self.profile
        return result

    def _busy(self) -> dict[str, Any]:
        by_mode = self._by_mode()
        wall_ms = self._t0.elapsed_time(self._t1)
        last_end = self.steps[-1]["end"] or self.steps[-1]["start"]
        idle_ms = sum(row["idle_before_ms"] for row in by_mode.values()) + max(0.0, last_end.elapsed_time(self._t1))
        decode = by_mode.get("DECODE", {})
        decode_idle = decode.get("idle_before_ms", 0.0)
        decode_span = decode_idle + decode.get("gpu_ms", 0.0)
        return {
            "by_mode": by_mode,
            "by_size": {"DECODE": self._by_size("DECODE", DECODE_BATCH_BOUNDS),
                        "EXTEND": self._by_size("EXTEND", EXTEND_TOKEN_BOUNDS)},
            "gpu_wall_ms": wall_ms,
            "gpu_idle_ms": idle_ms,
            "gpu_busy_fraction": 1.0 - idle_ms / wall_ms if wall_ms > 0 else 0.0,
            "gpu_busy_fraction_decode": 1.0 - decode_idle / decode_span if decode_span > 0 else 0.0,
        }

    def _by_mode(self) -> dict[str, dict[str, float]]:
        """Per step kind (DECODE, EXTEND, MIXED): steps, tokens, GPU ms from launch to sampling, the GPU idle
        ms just before such steps (where the stream waited on the host), and the steps below the small size."""
        table: dict[str, dict[str, float]] = {}
        for step, idle_ms in zip(self.steps, self._idle_before()):
            row = table.setdefault(step["mode"], {"steps": 0, "tokens": 0, "gpu_ms": 0.0, "idle_before_ms": 0.0,
                                                  "small_steps": 0, "small_gpu_ms": 0.0})
            gpu_ms = _gpu_ms(step)
            row["steps"] += 1
            row["tokens"] += step["tokens"]
            row["gpu_ms"] += gpu_ms
            row["idle_before_ms"] += idle_ms
            small = SMALL_DECODE_BATCH if step["mode"] == "DECODE" else SMALL_PREFILL_TOKENS
            if step["tokens"] < small:
                row["small_steps"] += 1
                row["small_gpu_ms"] += gpu_ms
        return table

    def _idle_before(self) -> list[float]:
        """Per step, the GPU ms between the end of the step before (or the window's start) and its launch."""
        idle, previous_end = [], self._t0
        for step in self.steps:
            idle.append(max(0.0, previous_end.elapsed_time(step["start"])))
            previous_end = step["end"] or step["start"]
        return idle

    def _trace(self) -> dict[str, Any]:
        """Every step in order, as columns: kind, batch size, tokens, requests waiting and running and free KV
        slots when it was launched, GPU ms, the GPU ms idle just before it (the stream waiting on the host); then
        host ms: since the step before was launched, and within them garbage collection, waiting for a step's
        tokens and reading a step (the wait included); last, the host ms its own launch took."""
        host_ms = [0.0] + [(b["host"] - a["host"]) * 1e3 for a, b in zip(self.steps, self.steps[1:])]
        idle = self._idle_before()
        stalls = []
        if self.sampler is not None:  # the host's busiest frames before each step the GPU waited 2 ms or more for
            stalls = [{"step": i, "idle_ms": round(idle[i], 3), "host_ms": round(host_ms[i], 3),
                       "frames": self.sampler.hot_frames(self.steps[i - 1]["host"], self.steps[i]["host"])}
                      for i in range(1, len(self.steps)) if idle[i] >= STALL_IDLE_MS]
        return {
            "columns": ["mode", "batch_size", "tokens", "waiting", "running", "free_kv", "gpu_ms", "idle_ms",
                        "host_ms", *HOST_PHASES, "launch_ms"],
            "steps": [[s["mode"][0], s["bs"], s["tokens"], s["waiting"], s["running"], s["free_kv"],
                       round(_gpu_ms(s), 3), round(idle_ms, 3), round(host, 3),
                       *(round(s[key], 3) for key in HOST_PHASES), round(s["launch_ms"], 3)]
                      for s, idle_ms, host in zip(self.steps, idle, host_ms)],
            "stalls": stalls,
        }

    def _by_size(self, mode: str, bounds: tuple[int, ...]) -> list[dict[str, float]]:
        """Steps of one kind grouped by size (batch size for decode, tokens for prefill; each group from its
        bound to the next one's): steps, tokens and GPU ms per group, to show how much of the time the small
        steps (a decode batch's ramp-up and drain, a short prefill) take against full ones."""
        groups = [{"min_size": low, "steps": 0, "tokens": 0, "gpu_ms": 0.0} for low in bounds]
        for step in self.steps:
            if step["mode"] != mode:
                continue
            size = step["bs"] if mode == "DECODE" else step["tokens"]
            group = next(g for g in reversed(groups) if size >= g["min_size"])
            group["steps"] += 1
            group["tokens"] += step["tokens"]
            group["gpu_ms"] += _gpu_ms(step)
        return [g for g in groups if g["steps"]]


def _gpu_ms(step: dict[str, Any]) -> float:
    """A step's GPU milliseconds, from its launch to the end of its sampling (0 when it has no end event)."""
    return max(0.0, step["start"].elapsed_time(step["end"] or step["start"]))


# A step the GPU waited this long for gets the host's sampled frames in the step trace's "stalls".
STALL_IDLE_MS = 2.0
# Host time between two launches, by kind, in the step trace (see StepMeter._trace).
HOST_PHASES = ("gc_ms", "wait_ms", "settle_ms")

# The size groups of StepMeter.summary's by_size: decode batch sizes, prefill tokens per step.
DECODE_BATCH_BOUNDS = (1, 32, 64, 128, 192, 256, 320, 384, 448, 512)
EXTEND_TOKEN_BOUNDS = (1, 256, 512, 1024, 1536, 2048, 4096)

# Prefill steps under this many tokens cost about one full read of the weights each, whatever they hold;
# decode batches under this size are bound by those reads too (the ramp-up and the drain of a run).
SMALL_PREFILL_TOKENS = 512
SMALL_DECODE_BATCH = 128


def kernel_category(name: str) -> str:
    """A coarse kind for a GPU kernel name: matmul, attention, copies, or elementwise/other."""
    lowered = name.lower()
    if any(key in lowered for key in ("gemv", "gemm", "nvjet", "xmma", "cutlass", "splitk", "split_k", "matmul",
                                      "small_batch", "int_dot", "_mma_", "dequantize_kernel",
                                      "recompute_kernel")):
        return "matmul (weights)"
    if any(key in lowered for key in ("flashinfer", "batchprefill", "batchdecode", "attention", "attn",
                                      "_fwd_kernel", "decode_", "mergestate", "merge_state")):
        return "attention"
    if "memcpy" in lowered or "memset" in lowered:
        return "memcpy/memset"
    if any(key in lowered for key in ("sort", "softmax", "argmax", "reduce", "topk", "cumsum", "chunk_top")):
        return "sampling/reductions"
    if "index" in lowered or "scatter" in lowered or "gather" in lowered:
        return "index/scatter/gather"
    return "elementwise/norm/rotary/other"


def _mean(values: list[int]) -> float:
    return sum(values) / len(values) if values else 0.0


def format_profile(name: str, profile: dict[str, Any]) -> str:
    """A few lines per profile window: GPU time by kind, host ops, and the host functions that cost most."""
    lines = [f"profile of {name} (triggered at decode batch {profile.get('trigger_batch_size')}):"]
    torch_window = profile.get("torch")
    if torch_window:
        lines.append(f"  torch.profiler, {torch_window['steps']} steps: wall {torch_window['wall_us_per_step_profiled']:.0f}"
                     f" us/step, GPU kernels {torch_window['gpu_kernel_us_per_step']:.0f} us/step")
        for category, us in torch_window["gpu_by_category_us_per_step"].items():
            lines.append(f"    {category:<36}{us:>9.0f} us/step")
        lines.append("    host ops (self CPU us/step): " + ", ".join(
            f"{name} {us:.0f}" for name, us in list(torch_window["top_host_ops_self_us_per_step"].items())[:8]))
    window = profile.get("cprofile")
    if window:
        lines.append(f"  cProfile, {window['steps']} steps: wall {window['wall_us_per_step_profiled']:.0f} us/step; "
                     "top cumulative (us/step):")
        for row in window["top_cumulative"][:18]:
            lines.append(f"    {row['cum_us_per_step']:>9.0f} {row['self_us_per_step']:>8.0f} "
                         f"{row['calls_per_step']:>7.1f}  {row['function']}")
    return "\n".join(lines)
