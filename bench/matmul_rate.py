"""The library matmul's rate at Llama-3.1-8B's projection shapes for prefill- and decode-batch-sized row counts.

``python -m treadle.bench.matmul_rate [--rows 256,512,1024,2048,4096,8192] [--blas cublas,cublaslt] [--output PATH]``

Per BLAS library (``torch.backends.cuda.preferred_blas_library``), row count M and projection (N x K): bfloat16
``F.linear`` timed with CUDA events over 30 calls, each on another of three weight copies, in TFLOP/s; the
``layer`` column is the four projections of one decoder layer together. A prefill step of M tokens and a decode
step of M requests run these matmuls, so this is the rate their weight FLOPs can reach (docs/lab/benchmarks-history.md,
"What 12,000 out tok/s would need").
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from treadle.bench.results_folder import results_dir

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}
CALLS = 30


def rate(rows: int, n: int, k: int) -> float:
    """Seconds per ``F.linear`` of ``rows`` x ``k`` by a ``n`` x ``k`` bfloat16 weight."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(3)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    for i in range(3):
        F.linear(x, weights[i])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for i in range(CALLS):
        F.linear(x, weights[i % 3])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS / 1e3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treadle.bench.matmul_rate")
    parser.add_argument("--rows", default="256,512,1024,2048,4096,8192")
    parser.add_argument("--blas", default="cublas,cublaslt", help="torch.backends.cuda.preferred_blas_library values")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("matmul_rate needs a CUDA device", file=sys.stderr)
        return 2
    results = []
    print(f"{'blas':9s} {'M':>5s} " + " ".join(f"{name:>12s}" for name in SHAPES) + f" {'layer':>7s} {'layer us':>9s}")
    for blas in args.blas.split(","):
        torch.backends.cuda.preferred_blas_library(blas)
        for rows in (int(r) for r in args.rows.split(",")):
            row = {"blas": blas, "rows": rows, "tflops": {}}
            seconds = flops = 0.0
            for name, (n, k) in SHAPES.items():
                t = rate(rows, n, k)
                row["tflops"][name] = 2 * rows * n * k / t / 1e12
                seconds, flops = seconds + t, flops + 2 * rows * n * k
            row["layer_tflops"], row["layer_us"] = flops / seconds / 1e12, seconds * 1e6
            results.append(row)
            print(f"{blas:9s} {rows:5d} " + " ".join(f"{v:12.0f}" for v in row["tflops"].values())
                  + f" {row['layer_tflops']:7.0f} {row['layer_us']:9.1f}", flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    report = {"benchmark": "matmul_rate", "command": "python -m treadle.bench.matmul_rate " + " ".join(sys.argv[1:]),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    output = Path(args.output) if args.output else (
        results_dir() / f"matmul_rate_{dt.date.today():%Y%m%d}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
