"""Arrival trace: Poisson arrivals straight into one scheduler (no HTTP, no IPC), timed step by step.

``treadle bench arrival-trace --set model.path=/tmp/l8b --set model.load_format=dummy
--dtype bfloat16 --device cuda --request-rate 4 --num-prompts 160 --input-len 16:600 --output-len 16:400
[--set KEY=VALUE ...] [--sync-debug]``

The server's latency is the engine's plus the HTTP/IPC path; this measures the engine's alone, the way
the server's scheduler process drives it (add what has arrived, run one ``step()``, repeat), and says
where each step's time went:

- on the host: building the batch, launching its forward, waiting for the previous step's tokens
  (``settle``), launching sampling;
- on the GPU (CUDA events, never a synchronize): each step's span and the idle gap before it.

It prints engine-side TTFT and inter-token-gap percentiles, the same split per step kind, and the steps
behind the slowest gaps. ``--sync-debug`` turns on ``torch.cuda.set_sync_debug_mode`` and lists every
Python line that synchronized the device during the run (overlap scheduling allows only the wait for
the previous step's tokens, which uses an event and is not reported).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import json
import random
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import torch

from treadle.bench.offline_throughput import add_config_args, base_overrides
from treadle.bench.roofline import synchronize
from treadle.bench.workloads import parse_len_range, random_workload, usable_token_ids
from treadle.core.config import load_config
from treadle.core.scheduling.step_timer import StepTimer, percentile, step_kinds


class StepTrace(StepTimer):
    """The runtime's step timer on one scheduler, and a cProfile of its first prefill/mixed forward launches."""

    def __init__(self, scheduler: Any, cprofile_steps: int = 0) -> None:
        super().__init__(scheduler.worker.info.device)
        self.scheduler = scheduler
        self.cprofile_steps = cprofile_steps
        self.cprofile = cProfile.Profile() if cprofile_steps > 0 else None
        self._profiling = False

    def install(self) -> None:
        self.scheduler.add_observer(self)

    def uninstall(self) -> None:
        self.scheduler.remove_observer(self)

    def forward_launching(self, batch: Any) -> None:
        super().forward_launching(batch)
        if self.cprofile is not None and self.cprofile_steps > 0 and self.current["mode"] != "DECODE":
            self.cprofile_steps -= 1
            self._profiling = True
            self.cprofile.enable()

    def forward_launched(self, batch: Any, step: Any) -> None:
        if self._profiling:
            self.cprofile.disable()
            self._profiling = False
        super().forward_launched(batch, step)

    def dump(self, path: str) -> None:
        """Stop observing, resolve the GPU times (one synchronize) and write the per-kind split and GPU busy share
        as JSON."""
        self.uninstall()
        super().dump(path)


def run(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    from treadle.core.request import Req, SamplingParams

    scheduler = engine.scheduler
    token_ids = usable_token_ids(engine.model_info["vocab_size"], engine.tokenizer)
    workload = random_workload(args.num_prompts, token_ids, parse_len_range(args.input_len),
                               parse_len_range(args.output_len), seed=args.seed)
    rng = random.Random(args.seed)
    offsets, t = [], 0.0
    for _ in workload.requests:
        t += rng.expovariate(args.request_rate)
        offsets.append(t)
    warm = [Req(rid=Req.new_rid(), origin_input_ids=list(r.input_ids),
                sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
            for r in workload.requests[:4]]
    for req in warm:
        scheduler.add_request(req)
    while scheduler.has_work():
        scheduler.step()
    engine.flush_cache()

    trace = StepTrace(scheduler, args.cprofile_steps)
    syncs: Counter[str] = Counter()
    arrival: dict[str, float] = {}
    token_times: dict[str, list[tuple[float, int]]] = {}  # rid -> (host time, step index) per output
    reqs = [Req(rid=Req.new_rid(), origin_input_ids=list(r.input_ids),
                sampling_params=SamplingParams(max_new_tokens=r.output_len, temperature=0.0, ignore_eos=True))
            for r in workload.requests]
    trace.install()
    if args.sync_debug and trace.on_cuda:
        torch.cuda.set_sync_debug_mode("warn")
    finished = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        next_req = 0
        while finished < len(reqs):
            now = time.perf_counter()
            while next_req < len(reqs) and start + offsets[next_req] <= now:
                arrival[reqs[next_req].rid] = start + offsets[next_req]
                scheduler.add_request(reqs[next_req])
                next_req += 1
            if not scheduler.has_work():
                time.sleep(max(0.0, start + offsets[next_req] - time.perf_counter()))
                continue
            outputs = scheduler.step()
            step = trace.steps[-1]
            for output in outputs:
                if output.new_token_ids:
                    token_times.setdefault(output.rid, []).append((step["host_end"], len(trace.steps) - 1))
                finished += output.finished_reason is not None
        wall = time.perf_counter() - start
    if trace.on_cuda:
        torch.cuda.set_sync_debug_mode(0)
    synchronize(scheduler.worker.info.device)
    trace.uninstall()
    trace.resolve_gpu_times()
    for warning in caught:
        if "synchroniz" in str(warning.message):
            syncs[f"{Path(warning.filename).name}:{warning.lineno}: {warning.message}"] += 1
    report = summarize(trace.steps, arrival, token_times, syncs, wall, workload, args)
    if trace.cprofile is not None:
        text = io.StringIO()
        pstats.Stats(trace.cprofile, stream=text).sort_stats("tottime").print_stats(30)
        report["cprofile_prefill_launch"] = text.getvalue()
    return report


def summarize(steps: list[dict[str, Any]], arrival: dict[str, float], token_times: dict[str, list[tuple[float, int]]],
              syncs: Counter[str], wall: float, workload: Any, args: argparse.Namespace) -> dict[str, Any]:
    ttft = [times[0][0] - arrival[rid] for rid, times in token_times.items()]
    gaps: list[tuple[float, int]] = []  # (gap seconds, index of the step whose end delivered the token)
    for times in token_times.values():
        gaps += [(b[0] - a[0], b[1]) for a, b in zip(times, times[1:])]
    gap_values = [g for g, _ in gaps]
    slow_share = sum(g > args.slow_gap_ms / 1e3 for g in gap_values) / max(1, len(gap_values))
    kinds = step_kinds(steps)
    slow = sorted({index for gap, index in gaps if gap > args.slow_gap_ms / 1e3})
    windows = [[_step_row(steps, i) for i in range(max(0, index - 2), index + 1)] for index in slow[: args.show_slow]]
    return {
        "command": "python -m treadle.bench.arrival_trace " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "workload": workload.summary(), "request_rate": args.request_rate, "wall_s": wall,
        "ttft_ms": {"p50": 1e3 * percentile(ttft, 0.5), "p99": 1e3 * percentile(ttft, 0.99)},
        "gaps": len(gap_values),
        "itl_ms": {"p50": 1e3 * percentile(gap_values, 0.5), "p90": 1e3 * percentile(gap_values, 0.9),
                   "p99": 1e3 * percentile(gap_values, 0.99),
                   f"share_over_{args.slow_gap_ms:g}ms": slow_share},
        "per_step_kind": kinds, "slow_gap_steps": len(slow), "slow_gap_windows": windows,
        "syncs": dict(syncs.most_common()),
    }


def _step_row(steps: list[dict[str, Any]], i: int) -> dict[str, Any]:
    """One step for the slow-gap listing: its kind and sizes, and its timings in milliseconds."""
    step = steps[i]
    row: dict[str, Any] = {"step": i}
    for key, value in step.items():
        if key not in ("host_start", "host_end"):
            row[key] = round(1e3 * value, 2) if isinstance(value, float) else value
    row["host_wall_ms"] = round(1e3 * (step["host_end"] - step["host_start"]), 2)
    return row


PHASES = {"build": "build ms", "forward": "forward launch ms", "settle": "settle ms", "sampling": "sampling ms",
          "gpu": "GPU ms", "gpu_idle_before": "GPU idle before ms"}


def format_report(report: dict[str, Any]) -> str:
    kinds = report["per_step_kind"]
    # Only phases some step measured: on the CPU there are no GPU times to show.
    phases = [name for name in PHASES if any(f"{name}_mean_ms" in k for k in kinds.values())]
    lines = [f"arrival trace: {report['workload']['num_requests']} requests at {report['request_rate']}/s, "
             f"{report['wall_s']:.1f} s on {report['device']}",
             "TTFT ms  p50 {p50:.1f}  p99 {p99:.1f}".format(**report["ttft_ms"]),
             "gap ms   " + "  ".join(f"{k} {v:.3g}" for k, v in report["itl_ms"].items()),
             "", "| step kind | steps | tokens | " + " | ".join(PHASES[n] for n in phases) + " |",
             "| --- | ---: | ---: |" + " ---: |" * len(phases)]
    for mode, k in kinds.items():
        cells = [f"{k[f'{n}_mean_ms']:.2f} / {k[f'{n}_p90_ms']:.2f}" if f"{n}_mean_ms" in k else "-" for n in phases]
        lines.append(f"| {mode} | {k['steps']} | {k['mean_tokens']:.0f} | " + " | ".join(cells) + " |")
    lines.append("(each cell: mean / p90)")
    if report["slow_gap_windows"]:
        lines.append(f"\n{report['slow_gap_steps']} steps delivered a gap over the threshold; the first few (slow), "
                     "with the two steps before each:")
        lines += format_slow_steps(report["slow_gap_windows"], phases)
    if report["syncs"]:
        lines.append("device synchronizations during the run:")
        lines += [f"  {count:6d}  {where}" for where, count in report["syncs"].items()]
    if report.get("cprofile_prefill_launch"):
        lines += ["", "host profile of the prefill/mixed forward launches (cProfile, by own time):",
                  report["cprofile_prefill_launch"]]
    return "\n".join(lines)


def format_slow_steps(windows: list[list[dict[str, Any]]], phases: list[str]) -> list[str]:
    """The slow-gap windows as one table, each step once (windows of neighbouring slow steps overlap); a gap in the
    step numbers starts a new block."""
    rows = {row["step"]: row for window in windows for row in window}
    slow = {window[-1]["step"] for window in windows}
    header = ["step", "kind", "bs", "tokens"] + [PHASES[n] for n in phases] + ["host wall ms", ""]
    lines = ["| " + " | ".join(header) + " |", "|" + " ---: |" * len(header)]
    previous = None
    for index in sorted(rows):
        row = rows[index]
        if previous is not None and index != previous + 1:
            lines.append("| ... |" + " |" * (len(header) - 1))
        cells = [str(index), str(row.get("mode", "-")), str(row.get("bs", "-")), str(row.get("tokens", "-"))]
        cells += [f"{row[n]:.2f}" if n in row else "-" for n in phases]
        cells += [f"{row['host_wall_ms']:.2f}", "slow" if index in slow else ""]
        lines.append("| " + " | ".join(cells) + " |")
        previous = index
    return lines


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="treadle bench arrival-trace", description=__doc__.split("\n")[0])
    add_config_args(p)
    p.add_argument("--request-rate", type=float, default=4.0)
    p.add_argument("--num-prompts", type=int, default=160)
    p.add_argument("--input-len", default="16:600")
    p.add_argument("--output-len", default="16:400")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slow-gap-ms", type=float, default=12.0, help="gaps above this count as slow")
    p.add_argument("--show-slow", type=int, default=6, help="slow-gap step windows to print")
    p.add_argument("--sync-debug", action="store_true")
    p.add_argument("--cprofile-steps", type=int, default=0,
                   help="cProfile the host side of this many prefill/mixed forward launches")
    p.add_argument("--output", default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from treadle.core.engine import Engine

    args = _parser().parse_args(argv)
    with Engine(load_config(args.config, base_overrides(args))) as engine:
        report = run(engine, args)
    print(format_report(report))
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
