"""Results of ``treadle bench offline``: one system's timing, the ratios, the table, the JSON report.

``SystemResult`` is what every system (a treadle variant or HF) produces; this module turns a run's
results into the ratios (vs the first system, vs HF, vs an earlier run's JSON with ``--baseline``),
the plain-text table, the one-line progress summary and the JSON report with the machine and commit.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from treadle.bench.workloads import Workload


@dataclass
class SystemResult:
    """Timing of one system on the workload."""

    name: str
    kind: str  # "treadle" or "hf"
    overrides: list[str]
    config: dict[str, Any]
    total_time_s: float
    num_requests: int
    input_tokens: int
    output_tokens: int
    generated_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)
    ratio_vs_first: float | None = None
    ratio_vs_hf: float | None = None
    ratio_vs_baseline: float | None = None  # vs the same-named system of an earlier run (--baseline)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.total_time_s

    @property
    def request_throughput(self) -> float:
        return self.num_requests / self.total_time_s

    def to_json(self) -> dict[str, Any]:
        values = asdict(self)
        values["output_throughput_tok_s"] = self.output_throughput
        values["request_throughput_req_s"] = self.request_throughput
        values["total_throughput_tok_s"] = (self.input_tokens + self.output_tokens) / self.total_time_s
        return values


def format_table(results: Sequence[SystemResult]) -> str:
    """A plain-text table, one row per system."""
    with_hf = any(r.kind == "hf" for r in results)
    with_baseline = any(r.ratio_vs_baseline is not None for r in results)
    with_busy = any("gpu_busy_fraction" in r.extra for r in results)
    with_spec = any("spec_acceptance_length" in r.extra for r in results)
    header = ["system", "reqs", "in tok", "out tok", "time s", "out tok/s", "req/s", "peak bs", "vs first"]
    if with_busy:
        header[-1:-1] = ["GPU busy", "busy (decode)"]
    if with_spec:
        header.append("accept len")
    if with_hf:
        header.append("vs hf")
    if with_baseline:
        header.append("vs baseline")
    rows = [header]
    for r in results:
        row = [r.name, str(r.num_requests), str(r.input_tokens), str(r.output_tokens), f"{r.total_time_s:.2f}",
               f"{r.output_throughput:.1f}", f"{r.request_throughput:.3f}",
               str(r.extra.get("peak_decode_batch_size", "-")), _ratio(r.ratio_vs_first)]
        if with_busy:
            row[-1:-1] = [_percent(r.extra.get("gpu_busy_fraction")), _percent(r.extra.get("gpu_busy_fraction_decode"))]
        if with_spec:
            length = r.extra.get("spec_acceptance_length")
            row.append("-" if length is None else f"{length:.2f}")
        if with_hf:
            row.append(_ratio(r.ratio_vs_hf))
        if with_baseline:
            row.append(_ratio(r.ratio_vs_baseline))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def fill_ratios(results: list[SystemResult]) -> None:
    """Each system's output throughput relative to the first system's and to HF's (when HF ran)."""
    first = results[0].output_throughput
    hf = next((r.output_throughput for r in results if r.kind == "hf"), None)
    for r in results:
        r.ratio_vs_first = r.output_throughput / first
        r.ratio_vs_hf = r.output_throughput / hf if hf else None


def fill_baseline_ratios(results: list[SystemResult], workload: Workload, path: Path) -> None:
    """Ratio of each system's throughput to the same-named system in an earlier run's JSON."""
    earlier = json.loads(path.read_text())
    same = {k: earlier["workload"].get(k) for k in ("name", "num_requests", "input_tokens", "output_tokens")}
    now = {"name": workload.name, "num_requests": workload.num_requests,
           "input_tokens": workload.input_tokens, "output_tokens": workload.output_tokens}
    if same != now:
        print(f"warning: the baseline {path} ran a different workload ({same} vs {now}); ratios are not "
              "like for like", file=sys.stderr)
    throughput = {system["name"]: system["output_throughput_tok_s"] for system in earlier["systems"]}
    for r in results:
        if r.name in throughput:
            r.ratio_vs_baseline = r.output_throughput / throughput[r.name]


def progress_line(r: SystemResult) -> str:
    """One system's figures as soon as it finishes (a later crash keeps them in the log)."""
    extra = r.extra
    return (f"{r.name}: {r.output_throughput:.1f} out tok/s, {r.total_time_s:.2f} s, peak decode batch "
            f"{extra.get('peak_decode_batch_size')}, GPU busy {_percent(extra.get('gpu_busy_fraction'))} "
            f"(decode {_percent(extra.get('gpu_busy_fraction_decode'))}), steps {extra.get('steps')} "
            f"({extra.get('decode_steps')} decode), max_running_requests {extra.get('max_running_requests')}, "
            f"retractions {extra.get('retractions')}" + _acceptance(extra) + _by_mode_lines(extra.get("by_mode"))
            + _by_size_lines(extra.get("by_size")) + _stall_lines((extra.get("step_trace") or {}).get("stalls")))


def _acceptance(extra: dict[str, Any]) -> str:
    """Speculative decoding: completion tokens per verify step."""
    length = extra.get("spec_acceptance_length")
    return "" if length is None else f", acceptance length {length:.2f} tokens/verify step"


def _by_mode_lines(by_mode: dict[str, dict[str, float]] | None) -> str:
    """Where the GPU's time went per step kind (from StepMeter)."""
    if not by_mode:
        return ""
    return "".join(
        f"\n  {mode}: {row['steps']} steps, {row['tokens']} tokens, GPU {row['gpu_ms'] / 1e3:.2f} s, idle before "
        f"{row['idle_before_ms'] / 1e3:.2f} s; small steps ({'batch < 128' if mode == 'DECODE' else '< 512 tokens'}) "
        f"{row['small_steps']} ({row['small_gpu_ms'] / 1e3:.2f} s)"
        for mode, row in by_mode.items())


def _stall_lines(stalls: list[dict[str, Any]] | None, top: int = 3) -> str:
    """With --step-trace: the steps the GPU waited 2 ms or more for, and the host frames most often behind them."""
    if not stalls:
        return ""
    busiest: dict[str, float] = {}
    for stall in stalls:
        for frames, ms in stall["frames"]:
            innermost = frames.split(" < ")[0]
            busiest[innermost] = busiest.get(innermost, 0.0) + ms
    ranked = sorted(busiest.items(), key=lambda item: -item[1])[:top]
    return (f"\n  GPU stalls (>= 2 ms idle): {len(stalls)} steps, {sum(s['idle_ms'] for s in stalls) / 1e3:.2f} s; "
            "host busiest before them: " + ", ".join(f"{where} {ms:.0f} ms" for where, ms in ranked))


def _by_size_lines(by_size: dict[str, list[dict[str, float]]] | None) -> str:
    """Steps per size group (StepMeter): steps, GPU seconds and microseconds per token."""
    if not by_size:
        return ""
    unit = {"DECODE": "decode by batch size", "EXTEND": "prefill by tokens per step"}
    return "".join(
        f"\n  {unit.get(mode, mode)}: " + ", ".join(
            f"{g['min_size']}+: {g['steps']} steps {g['gpu_ms'] / 1e3:.2f} s {1e3 * g['gpu_ms'] / g['tokens']:.0f} us/tok"
            for g in groups)
        for mode, groups in by_size.items() if groups)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def build_report(args: argparse.Namespace, argv: Sequence[str] | None, workload: Workload,
                 results: list[SystemResult]) -> dict[str, Any]:
    """The run's JSON: command, date, machine, commit, workload, every system and the ratios."""
    argv = list(sys.argv[1:] if argv is None else argv)
    hf = next((r for r in results if r.kind == "hf"), None)
    return {
        "benchmark": "offline_throughput",
        "command": "treadle bench offline " + shlex.join(argv),
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "treadle_commit": git_commit(),
        "workload": workload.summary(),
        "hf_batch_size": args.hf_batch_size if hf else None,
        "warmup_prompts": args.warmup_prompts,
        "systems": [r.to_json() for r in results],
        "ratios": {
            "vs_first": {r.name: r.ratio_vs_first for r in results},
            "vs_hf": {r.name: r.ratio_vs_hf for r in results} if hf else None,
        },
    }


def machine_info() -> dict[str, Any]:
    """CPU model, core count, load, torch build and GPU name (when there is one)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
    }
    if hasattr(os, "getloadavg"):
        info["loadavg_1_5_15"] = list(os.getloadavg())
    return info


def git_commit() -> dict[str, Any] | None:
    """HEAD of the treadle checkout and whether the working tree has changes; None outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True,
                                timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"head": head, "dirty": bool(status.strip())}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
