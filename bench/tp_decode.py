"""Tensor-parallel decode with NCCL against the peer-to-peer all-reduce: all-reduce latency by message size, then
the bs=1 decode step of Llama-3.1-8B shapes at tp=1, tp=2 over NCCL and tp=2 over the peer all-reduce.

    treadle bench tp-decode --output bench/results/tp_decode_2xh100.json   # or python -m treadle.bench.tp_decode

Part 1 (``--skip-latency`` leaves it out): ``--world`` ranks (2) capture ``--calls`` back-to-back all-reduces of one
size in a CUDA graph per method (NCCL, one-shot, two-shot) and time its replays: microseconds per all-reduce. Then
the decode step's pattern at one row of ``--hidden`` sizes: the all-reduce fused with the residual add + RMSNorm
alone, a one-row GEMV alone (a down_proj's share of 3.5 x hidden inputs per rank) and the GEMV followed by the fused
all-reduce, as the step runs them (PDL launches): the last minus the GEMV is what the all-reduce adds to a layer.
Each with up to 1-8 programs sharing the row (``TREADLE_AR_SPLIT``). Part 2 runs
``treadle bench one-batch`` three times (``--tp 1``; ``--tp 2 --custom-all-reduce false``; ``--tp 2
--custom-all-reduce true``), CUDA graphs on, and reads their JSON. Prints both tables; writes one JSON.
Target (issue 48): tp=2 bs=1 step <= 0.60x tp=1.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from treadle.bench.results_folder import write_result
from treadle.core.execution.cuda_graph import replay_seconds
from treadle.testing.all_reduce import run_ranks

KiB = 1024
SIZES = (8 * KiB, 32 * KiB, 128 * KiB, 512 * KiB, 2048 * KiB, 8192 * KiB)
RUNS = (("tp1", ["--tp", "1"]), ("tp2_nccl", ["--tp", "2", "--custom-all-reduce", "false"]),
        ("tp2_custom", ["--tp", "2", "--custom-all-reduce", "true"]))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result: dict[str, Any] = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "command": " ".join(["python -m treadle.bench.tp_decode", *(argv or sys.argv[1:])]),
                              "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    if not args.skip_latency:
        hidden = [int(h) for h in args.hidden.split(",") if h]
        result["world"] = args.world
        result["all_reduce_us"], result["row_us"] = all_reduce_latency(args.world, args.calls, args.replays, hidden,
                                                                       args.timeout_s)
        print(latency_table(result["all_reduce_us"]), flush=True)
        print(row_table(result["row_us"]), flush=True)
    if not args.skip_decode:
        result["decode"] = decode_steps(args)
        print(decode_table(result["decode"]), flush=True)
    write_result(result, args.output, f"tp_decode_{dt.date.today():%Y%m%d}.json")
    return 0


def all_reduce_latency(world: int, calls: int, replays: int, hidden: Sequence[int],
                       timeout_s: float) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """``({size: {method: µs per all-reduce}}, {"1 x hidden": {pattern: µs per call}})``, rank 0's timing of graph
    replays (every rank replays alike)."""
    reports = run_ranks(world, _latency_rank, (calls, replays, tuple(hidden)), timeout_s)
    return reports[0]["latency_us"], reports[0]["row_us"]


def _latency_rank(rank: int, world_size: int, init_method: str, calls: int, replays: int,
                  hidden: tuple[int, ...]) -> dict[str, Any]:
    import torch.distributed as dist

    from treadle.core.distributed.custom_all_reduce import ONE_SHOT, TWO_SHOT, setup_custom_all_reduce
    from treadle.core.distributed.parallel import destroy_tensor_parallel, init_tensor_parallel

    device = torch.device("cuda", rank)
    init_tensor_parallel(rank, world_size, init_method, device, timeout_s=120.0)
    try:
        fast = setup_custom_all_reduce(True, device, 1, list(range(world_size)))
        methods = {"nccl": lambda x: dist.all_reduce(x), ONE_SHOT: lambda x: fast.reduce(x, ONE_SHOT),
                   TWO_SHOT: lambda x: fast.reduce(x, TWO_SHOT)}
        latency: dict[str, dict[str, float]] = {}
        for nbytes in SIZES:
            x = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=device)
            latency[f"{nbytes // KiB} KiB"] = {name: _graph_us(run, x, calls, replays) for name, run in methods.items()}
        rows = {f"1 x {h}": _row_patterns(fast, h, world_size, device, calls, replays) for h in hidden}
        return {"latency_us": latency, "row_us": rows, "errors": fast.error_count()}
    finally:
        destroy_tensor_parallel()


def _graph_us(run: Any, x: torch.Tensor, calls: int, replays: int) -> float:
    import torch.distributed as dist

    run(x)  # compiled and warm before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run(x)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()  # both ranks start timing together
    return replay_seconds(graph, replays) * 1e6 / calls


def _row_patterns(fast: Any, hidden: int, world_size: int, device: torch.device, calls: int,
                  replays: int) -> dict[str, float]:
    """µs per call of the decode step's all-reduce patterns at one row of ``hidden`` (see the module docstring)."""
    from treadle.kernels.small_batch import SmallBatchConfig, small_batch_matmul

    gen = torch.Generator(device=device).manual_seed(0)
    inputs = int(3.5 * hidden) // world_size
    weight = torch.randn(hidden, inputs, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
    a = torch.randn(1, inputs, generator=gen, device=device, dtype=torch.bfloat16)
    residual = torch.randn(1, hidden, generator=gen, device=device, dtype=torch.bfloat16)
    norm_weight = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    gemv = SmallBatchConfig(4, 2048, 8, 4, gemv=True)

    def ar_norm(x: torch.Tensor) -> None:
        fast.all_reduce_add_rmsnorm(x, residual, norm_weight, 1e-5)

    def gemv_only(x: torch.Tensor) -> None:
        small_batch_matmul(a, weight, None, gemv)

    def gemv_ar_norm(x: torch.Tensor) -> None:
        fast.all_reduce_add_rmsnorm(small_batch_matmul(a, weight, None, gemv), residual, norm_weight, 1e-5)

    x = torch.randn(1, hidden, generator=gen, device=device, dtype=torch.bfloat16)
    out = {"gemv": _graph_us(gemv_only, x, calls, replays)}
    for most in (1, 2, 4, 8):  # a row of 8192 takes up to 4 slices by default (slices_per_row)
        fast.row_split = most
        out[f"ar_norm, up to {most} slices"] = _graph_us(ar_norm, x, calls, replays)
        out[f"added, up to {most} slices"] = _graph_us(gemv_ar_norm, x, calls, replays) - out["gemv"]
    fast.row_split = fast.ROW_SPLIT
    return out


def decode_steps(args: argparse.Namespace) -> dict[str, Any]:
    """Each run's one-batch rows (triton, graphs on) by name; a run that fails records its error and log tail."""
    runs: dict[str, Any] = {}
    folder = Path(tempfile.mkdtemp(prefix="treadle-tp-decode-"))
    for name, extra in RUNS:
        out = folder / f"{name}.json"
        cmd = [sys.executable, "-m", "treadle.bench.one_batch", *extra, "--batch-sizes", args.batch_sizes,
               "--backends", args.backend, "--graphs", "on", "--no-hf", "--no-profile", "--output", str(out)]
        print("running:", " ".join(cmd[1:]), flush=True)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            runs[name] = {"error": f"timed out after {args.timeout_s:g} s"}
            continue
        if done.returncode != 0 or not out.exists():
            runs[name] = {"error": f"exit {done.returncode}", "log_tail": (done.stdout + done.stderr)[-3000:]}
            print(runs[name]["log_tail"], flush=True)
            continue
        report = json.loads(out.read_text())
        runs[name] = {"all_reduce": report.get("all_reduce", "nccl"),
                      "rows": [{k: row.get(k) for k in ("system", "batch_size", "decode_step_ms", "first_tokens")}
                               for row in report["results"] if row.get("decode_step_ms")]}
    return runs


def latency_table(latency: dict[str, dict[str, float]]) -> str:
    lines = ["| message | NCCL µs | one-shot µs | two-shot µs | best peer / NCCL |", "|---|---:|---:|---:|---:|"]
    for size, by in latency.items():
        best = min(by["one_shot"], by["two_shot"])
        lines.append(f"| {size} | {by['nccl']:.1f} | {by['one_shot']:.1f} | {by['two_shot']:.1f} | "
                     f"{best / by['nccl']:.2f}x |")
    return "\n".join(lines)


def row_table(rows: dict[str, dict[str, float]]) -> str:
    sizes = list(rows)
    lines = ["| one row: µs per call | " + " | ".join(sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for pattern in next(iter(rows.values()), {}):
        lines.append(f"| {pattern} | " + " | ".join(f"{rows[size][pattern]:.2f}" for size in sizes) + " |")
    return "\n".join(lines)


def decode_table(runs: dict[str, Any]) -> str:
    base = {(r["system"], r["batch_size"]): r for r in runs.get("tp1", {}).get("rows", [])}
    lines = ["| run | all-reduce | bs | ms/step | / tp1 | first tokens as tp1 |", "|---|---|---:|---:|---:|---|"]
    for name, run in runs.items():
        if "error" in run:
            lines.append(f"| {name} | failed: {run['error']} | | | | |")
            continue
        for row in run["rows"]:
            ref = base.get((row["system"], row["batch_size"]))
            ratio = f"{row['decode_step_ms'] / ref['decode_step_ms']:.2f}x" if ref else "-"
            same = "-" if ref is None else str(row["first_tokens"] == ref["first_tokens"])
            lines.append(f"| {name} | {'peer' if run['all_reduce'].startswith('peer') else 'nccl'} | {row['batch_size']} | {row['decode_step_ms']:.2f} | "
                         f"{ratio} | {same} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle bench tp-decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--world", type=int, default=2, help="ranks (GPUs) of the latency part (default 2)")
    parser.add_argument("--hidden", default="4096,8192", help="row widths of the fused all-reduce patterns")
    parser.add_argument("--calls", type=int, default=50, help="all-reduces per captured graph (default 50)")
    parser.add_argument("--replays", type=int, default=20, help="timed graph replays per size and method")
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=400.0, help="per part and per decode run")
    parser.add_argument("--output", default=None, help="JSON path (default <results folder>/tp_decode_<date>.json)")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
