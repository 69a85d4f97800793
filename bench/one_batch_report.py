"""Rows, table and machine description of `treadle bench one-batch`'s report."""

from __future__ import annotations

import datetime as dt
import platform
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

# The ``backend`` of the hf-compiled peer's rows (HF eager rows have none): the table's ``x hf-compiled`` column.
HF_COMPILED = "hf-compiled"


@dataclass
class Measurement:
    """One system at one batch size."""

    system: str
    backend: str | None
    cuda_graph: bool | None
    batch_size: int
    prefill_ms: float
    decode_step_ms: float  # median
    decode_step_ms_mean: float
    decode_tokens_per_s: float
    roofline_ms: float
    roofline_fraction: float
    first_tokens: list[int] = field(default_factory=list)
    ratio_vs_baseline: float | None = None  # tok/s vs the same system and batch size of an earlier run
    ratio_vs_first: float | None = None  # tok/s vs the run's first treadle system at this batch size
    # treadle only: the median host time of a step until everything is launched, and the mean step when steps run
    # back to back without waiting for each (the GPU's time: what an engine that builds the next step meanwhile sees)
    decode_host_ms: float | None = None
    decode_step_ms_back_to_back: float | None = None
    # treadle's Engine.generate timed whole, as the HF peers' generate is (one_batch_engine.py)
    engine: bool = False


def measurement(system: str, backend: str | None, graph: bool | None, bs: int, prefill_s: float,
                step_times: list[float], first_tokens: list[int], roofline_s: float,
                host_times: list[float] | None = None, back_to_back_s: float | None = None,
                engine: bool = False) -> Measurement:
    """A row from raw timings: the median decode step sets tok/s and the fraction of the roofline."""
    median = statistics.median(step_times)
    return Measurement(
        system=system, backend=backend, cuda_graph=graph, batch_size=bs, prefill_ms=prefill_s * 1e3,
        decode_step_ms=median * 1e3, decode_step_ms_mean=statistics.fmean(step_times) * 1e3,
        decode_tokens_per_s=bs / median, roofline_ms=roofline_s * 1e3, roofline_fraction=roofline_s / median,
        first_tokens=first_tokens,
        decode_host_ms=statistics.median(host_times) * 1e3 if host_times else None,
        decode_step_ms_back_to_back=back_to_back_s * 1e3 if back_to_back_s is not None else None, engine=engine,
    )


def whole_call_steps(generate: Callable[[int], tuple[float, Any]], new_tokens: int,
                     repeats: int) -> tuple[float, list[float], Any]:
    """A decode step of a ``generate`` timed whole: ``generate(n)`` returns (seconds, output) for n new tokens.

    Calls for 1 token and for ``new_tokens`` alternate ``repeats`` times; each pair gives a step
    ``(time for N - time for 1) / (N - 1)``, whose median the row reports (one pair's host hiccup or a prefill
    that ran slower moves a single sample by tenths of a millisecond a step at 32 requests). Returns the median
    time for 1 token (the prefill), the steps of every pair, and the output of the last call for N.
    """
    ones, steps, output = [], [], None
    for _ in range(repeats):
        one, _ = generate(1)
        full, output = generate(new_tokens)
        ones.append(one)
        steps.append((full - one) / max(new_tokens - 1, 1))
    return statistics.median(ones), steps, output


def format_row(r: Measurement) -> str:
    """The progress line printed as each row is measured."""
    line = (f"{r.system} bs={r.batch_size}: prefill {r.prefill_ms:.1f} ms, decode {r.decode_step_ms:.2f} ms/step "
            f"({r.decode_tokens_per_s:.1f} tok/s, {100 * r.roofline_fraction:.1f}% of roofline)")
    if r.decode_step_ms_back_to_back is not None:
        line += (f"; back to back {r.decode_step_ms_back_to_back:.2f} ms/step, host {r.decode_host_ms:.2f} ms of each "
                 "synchronized step")
    return line


def fill_baseline_ratios(results: Sequence[Measurement], earlier: dict[str, Any]) -> None:
    """Each result's tok/s over the same system at the same batch size in an earlier run's JSON."""
    before = {(r["system"], r["batch_size"]): r["decode_tokens_per_s"] for r in earlier["results"]}
    for r in results:
        if (r.system, r.batch_size) in before:
            r.ratio_vs_baseline = r.decode_tokens_per_s / before[(r.system, r.batch_size)]


def fill_first_ratios(results: Sequence[Measurement]) -> None:
    """Where a batch size has several treadle systems (backends, ``--compare`` variants), each one's tok/s over
    the first of them: FP8 against bf16 weights with ``--compare "model.quantization=null,model.quantization=fp8"``.
    Engine.generate rows are compared among themselves."""
    treadle = [r for r in results if r.backend not in (None, HF_COMPILED)]
    for bs, engine in {(r.batch_size, r.engine) for r in treadle}:
        same = [r for r in treadle if r.batch_size == bs and r.engine == engine]
        if len(same) > 1:
            for r in same:
                r.ratio_vs_first = r.decode_tokens_per_s / same[0].decode_tokens_per_s


def format_table(results: Sequence[Measurement]) -> str:
    hf = {r.batch_size: r for r in results if r.backend is None}
    compiled = {r.batch_size: r for r in results if r.backend == HF_COMPILED}
    with_baseline = any(r.ratio_vs_baseline is not None for r in results)
    with_first = any(r.ratio_vs_first is not None for r in results)
    header = (f"{'system':<42}{'bs':>4}{'prefill ms':>12}{'step ms':>10}{'b2b ms':>9}{'tok/s':>10}"
              f"{'roofline ms':>13}{'% roofline':>12}{'x HF':>8}"
              + (f"{'x hf-compiled':>15}" if compiled else "") + (f"{'x baseline':>12}" if with_baseline else "")
              + (f"{'x first':>9}" if with_first else ""))
    lines = [header, "-" * len(header)]
    for r in results:
        ref = hf.get(r.batch_size)
        vs_hf = f"{r.decode_tokens_per_s / ref.decode_tokens_per_s:.2f}" if ref else "-"
        b2b = f"{r.decode_step_ms_back_to_back:.2f}" if r.decode_step_ms_back_to_back is not None else "-"
        line = (f"{r.system:<42}{r.batch_size:>4}{r.prefill_ms:>12.1f}{r.decode_step_ms:>10.2f}{b2b:>9}"
                f"{r.decode_tokens_per_s:>10.1f}{r.roofline_ms:>13.2f}{100 * r.roofline_fraction:>11.1f}%{vs_hf:>8}")
        if compiled:
            peer = compiled.get(r.batch_size)
            line += f"{r.decode_tokens_per_s / peer.decode_tokens_per_s:>15.2f}" if peer else f"{'-':>15}"
        if with_baseline:
            line += f"{r.ratio_vs_baseline:>12.2f}" if r.ratio_vs_baseline is not None else f"{'-':>12}"
        if with_first:
            line += f"{r.ratio_vs_first:>9.2f}" if r.ratio_vs_first is not None else f"{'-':>9}"
        lines.append(line)
    return "\n".join(lines)


def format_profile(profile: dict[str, Any]) -> str:
    lines = [f"profile: {profile['system']}, {profile.get('what', 'bs=1 decode')}, {profile['steps']} steps: wall "
             f"{profile['wall_us_per_step_profiled']:.0f} us/step, GPU busy {profile['gpu_busy_us_per_step']:.0f} "
             f"us/step, {profile['kernels_per_step']:.0f} kernels/step"]
    if "gpu_idle_in_step_us_per_step" in profile:
        lines.append(f"  GPU busy (overlaps once) {profile['gpu_union_us_per_step']:.0f} us/step, idle between a "
                     f"step's kernels {profile['gpu_idle_in_step_us_per_step']:.0f} us/step")
    for category, us in profile["by_category_us_per_step"].items():
        lines.append(f"  {category:<34}{us:>9.0f} us/step")
    for what, us in profile.get("host_us_per_step", {}).items():
        lines.append(f"  {what:<54}{us:>7.0f} us/step")
    lines.append("  top kernels (us/step, calls/step):")
    for k in profile["top_kernels"][:10]:
        lines.append(f"    {k['us_per_step']:>8.0f} {k['calls_per_step']:>6.0f}  {k['name']}")
    return "\n".join(lines)


def machine_info(device: torch.device) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("torch", "triton", "flashinfer-python", "transformers"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
    }


def default_output_name(gpu: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return f"one_batch_{slug}_{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
