"""Draw what a benchmark measured: ``treadle bench plot [LABEL=]RESULT.json ... [--output PNG]``.

Every file is a benchmark's JSON (``treadle bench offline``, ``one-batch`` or ``serving``; one kind
per plot); several are overlaid, each under its label (``before=a.json after=b.json``; without
one, the file's name).

- ``offline`` and ``one-batch``: horizontal throughput bars, one panel per workload (offline) or
  batch size (one-batch), each bar annotated with its figure and its ratio to the panel's
  reference bar (the first, or the first whose name contains ``--reference``, e.g. ``hf``).
- ``serving``: the cumulative distributions of time to first token and of inter-token latency
  (every gap when the run kept them, ``--keep-token-gaps``; else each request's mean gap), and
  output throughput against the request rate: runs under one label form one curve (a peer's
  runs under another label form another).

Needs matplotlib: ``pip install 'treadle[plot]'``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from treadle.bench.results_folder import results_dir

KINDS = {"offline_throughput": "offline", "one_batch": "one-batch", "serving": "serving"}


@dataclass(frozen=True)
class Run:
    """One result file and the label it is drawn under."""

    label: str
    path: Path
    result: dict[str, Any]

    @property
    def kind(self) -> str:
        return KINDS.get(self.result.get("benchmark", ""), self.result.get("benchmark", "unknown"))


@dataclass(frozen=True)
class Bar:
    label: str
    value: float


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    runs = [load_run(spec) for spec in args.results]
    kinds = {run.kind for run in runs}
    if len(kinds) != 1 or not kinds <= set(KINDS.values()):
        raise SystemExit("error: bench plot draws offline, one-batch or serving results, one kind per plot; got "
                         + ", ".join(f"{run.path.name}: {run.kind}" for run in runs))
    plt = _pyplot()
    kind = kinds.pop()
    include = [part for part in (args.include or "").split(",") if part]
    if kind == "serving":
        figure = draw_serving(plt, runs)
    else:
        panels = offline_panels(runs, include) if kind == "offline" else one_batch_panels(runs, include)
        unit = "out tok/s" if kind == "offline" else "decode tok/s"
        figure = draw_bars(plt, panels, unit, args.reference)
    figure.suptitle(args.title or _default_title(kind, runs), fontsize=11)
    figure.tight_layout()
    output = Path(args.output) if args.output else results_dir() / f"{runs[0].path.stem}.png"
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=args.dpi)
    print(f"wrote {output}")
    return 0


def load_run(spec: str) -> Run:
    """``LABEL=PATH`` or ``PATH`` (labelled by the file's name)."""
    label, _, path = spec.rpartition("=") if "=" in spec and not Path(spec).exists() else ("", "", spec)
    file = Path(path)
    try:
        result = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: cannot read benchmark results from {file}: {exc}") from None
    return Run(label or file.stem, file, result)


def offline_panels(runs: list[Run], include: list[str]) -> dict[str, list[Bar]]:
    """One panel per workload; a bar per system of each run."""
    panels: dict[str, list[Bar]] = {}
    for run in runs:
        workload = run.result["workload"]
        title = f"{workload['name']}, {workload['num_requests']} requests"
        for system in run.result["systems"]:
            label = _bar_label(run, system["name"], runs)
            if _kept(label, include):
                panels.setdefault(title, []).append(Bar(label, system["output_throughput_tok_s"]))
    return panels


def one_batch_panels(runs: list[Run], include: list[str]) -> dict[str, list[Bar]]:
    """One panel per batch size; a bar per system of each run."""
    panels: dict[str, list[Bar]] = {}
    for run in runs:
        for row in sorted(run.result["results"], key=lambda r: r["batch_size"]):
            label = _bar_label(run, row["system"], runs)
            if _kept(label, include):
                panels.setdefault(f"batch size {row['batch_size']}", []).append(
                    Bar(label, row["decode_tokens_per_s"]))
    return panels


def draw_bars(plt: Any, panels: dict[str, list[Bar]], unit: str, reference: str | None) -> Any:
    """Horizontal bars per panel, each labelled with its value and its ratio to the panel's reference bar."""
    if not panels:
        raise SystemExit("error: no result is left to draw (check --include)")
    tallest = max(len(bars) for bars in panels.values())
    figure, axes = plt.subplots(len(panels), 1, figsize=(9, 0.9 + 0.42 * tallest * len(panels)), squeeze=False)
    for ax, (title, bars) in zip(axes[:, 0], panels.items()):
        base = next((bar for bar in bars if reference and reference in bar.label), bars[0])
        names = [bar.label for bar in bars][::-1]
        values = [bar.value for bar in bars][::-1]
        colors = ["#4c72b0" if bar is not base else "#8c8c8c" for bar in bars][::-1]
        ax.barh(names, values, color=colors)
        for y, value in enumerate(values):
            ratio = value / base.value if base.value else math.nan
            ax.text(value, y, f"  {_figure(value)}  {ratio:.2f}×", va="center", fontsize=8)
        ax.set_xlim(0, max(values) * 1.3)
        ax.set_title(f"{title} ({unit}; ratios to the grey bar)", fontsize=9, loc="left")
        ax.tick_params(axis="y", labelsize=8)
        ax.tick_params(axis="x", labelsize=8)
    return figure


def draw_serving(plt: Any, runs: list[Run]) -> Any:
    """TTFT and ITL distributions per run, and output throughput against the request rate per label."""
    figure, (ttft_ax, itl_ax, rate_ax) = plt.subplots(1, 3, figsize=(13, 3.8))
    any_gaps = False
    ttfts, itls = [], []
    for run in runs:
        done = [r for r in run.result["requests"] if r["ok"]]
        name = f"{run.label} @ {_rate_text(run.result['request_rate'])}"
        ttfts += _cdf(ttft_ax, [1e3 * r["ttft_s"] for r in done], name)
        gaps, kept = _token_gaps_ms(done)
        any_gaps |= kept
        itls += _cdf(itl_ax, gaps, name)
    for ax, values in ((ttft_ax, ttfts), (itl_ax, itls)):
        if values and min(values) > 0 and max(values) / min(values) > 50:  # runs of very different loads
            ax.set_xscale("log")
    ttft_ax.set_xlabel("time to first token (ms)")
    itl_ax.set_xlabel("inter-token latency (ms)" + ("" if any_gaps else ", each request's mean"))
    for ax in (ttft_ax, itl_ax):
        ax.set_ylabel("share of requests" if ax is ttft_ax or not any_gaps else "share of gaps")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _throughput_against_rate(rate_ax, runs)
    return figure


def _throughput_against_rate(ax: Any, runs: list[Run]) -> None:
    finite = [float(r.result["request_rate"]) for r in runs if _rate(r) != math.inf]
    all_at_once = 2 * max(finite) if finite else 1.0  # where "inf" (every request at once) is drawn
    curves: dict[str, list[tuple[float, float]]] = {}
    for run in runs:
        x = _rate(run) if _rate(run) != math.inf else all_at_once
        curves.setdefault(run.label, []).append((x, run.result["summary"]["output_token_throughput"]))
    for label, points in curves.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        for x, y in points:
            ax.annotate(_figure(y), (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ticks = sorted({x for points in curves.values() for x, _ in points})
    ax.set_xticks(ticks, [("all at once" if x == all_at_once and len(finite) < len(runs) else f"{x:g}")
                          for x in ticks], fontsize=8)
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(0, 1.15 * max(y for points in curves.values() for _, y in points))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def _token_gaps_ms(done: list[dict[str, Any]]) -> tuple[list[float], bool]:
    """Every gap when the run kept them, else each request's mean gap after its first token."""
    if any(r.get("itl_s") for r in done):
        return [1e3 * gap for r in done for gap in (r.get("itl_s") or [])], True
    return [1e3 * (r["latency_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)
            for r in done if r["output_tokens"] > 1], False


def _cdf(ax: Any, values: list[float], label: str) -> list[float]:
    """Draw the cumulative distribution of ``values``; returns them sorted."""
    ordered = sorted(values)
    if ordered:
        ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=label)
    return ordered


def _rate(run: Run) -> float:
    rate = run.result["request_rate"]
    return math.inf if rate in ("inf", None) else float(rate)


def _rate_text(rate: Any) -> str:
    return "all at once" if rate in ("inf", None) or rate == math.inf else f"{float(rate):g} req/s"


def _bar_label(run: Run, system: str, runs: list[Run]) -> str:
    return system if len(runs) == 1 else f"{run.label}: {system}"


def _kept(label: str, include: list[str]) -> bool:
    return not include or any(part in label for part in include)


def _figure(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _default_title(kind: str, runs: list[Run]) -> str:
    machine = runs[0].result.get("machine", {})
    where = machine.get("gpu") or machine.get("cpu") or ""
    return f"treadle bench {kind}" + (f" on {where}" if where else "")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("error: treadle bench plot needs matplotlib: pip install 'treadle[plot]'") from None
    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    return plt


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle bench plot", description=__doc__.split("\n\n")[0],
                                     epilog="e.g. treadle bench plot before=old.json after=new.json --reference before")
    parser.add_argument("results", nargs="+", metavar="[LABEL=]RESULT.json",
                        help="benchmark JSON files of one kind, each drawn under LABEL (default: the file's name)")
    parser.add_argument("--output", "-o", help="PNG path (default <results folder>/<first file's name>.png)")
    parser.add_argument("--reference", help="bars' ratios are to the first bar whose name contains this "
                                            "(default: each panel's first bar)")
    parser.add_argument("--include", help="comma-separated: draw only bars whose name contains one of these")
    parser.add_argument("--title", help="the figure's title (default: the benchmark and the machine)")
    parser.add_argument("--dpi", type=int, default=100)
    return parser


if __name__ == "__main__":
    sys.exit(main())
