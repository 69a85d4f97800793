"""FP8 linear kernels at Llama-3.1-8B's projection shapes: device time per call, replayed from CUDA graphs.

``python -m treadle.bench.fp8_linear [--rows 1,16,32,256] [--output PATH]`` (GPU with FP8 tensor cores)

Per shape (N x K) and number of rows M: bfloat16 ``F.linear``; FP8 W8A8 (per-token quantization
kernel + ``torch._scaled_mm``); FP8 W8A16 (the Triton kernel, every launch config; the one-row GEMV configs
at one row only, as the engine runs them). Reported in microseconds and in weight bytes read per second.
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

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}


def main(argv: Sequence[str] | None = None) -> int:
    from treadle.plugins.models.fp8 import _graph_seconds
    from treadle.plugins.models.fp8_kernels import W8A16_CONFIGS, w8a16_matmul
    from treadle.plugins.models.fp8_ops import fp8_matmul, quantize_per_channel, quantize_per_token

    parser = argparse.ArgumentParser(prog="python -m treadle.bench.fp8_linear")
    parser.add_argument("--rows", default="1,16,32,256")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for name, (n, k) in SHAPES.items():
        weight = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        wq, ws = quantize_per_channel(weight)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
            timings = {
                "bf16 F.linear": (_graph_seconds(lambda: F.linear(x, weight)), 2 * n * k),
                "fp8 w8a8 _scaled_mm": (_graph_seconds(lambda: fp8_matmul(*quantize_per_token(x), wq, ws,
                                                                           torch.bfloat16)), n * k),
            }
            if rows <= 16:
                for config in (c for c in W8A16_CONFIGS if rows == 1 or not c.gemv):
                    seconds = _graph_seconds(lambda config=config: w8a16_matmul(x, wq, ws, config))
                    timings[f"fp8 w8a16 {config}"] = (seconds, n * k)
            for kernel, (seconds, weight_bytes) in timings.items():
                results.append({"shape": name, "n": n, "k": k, "rows": rows, "kernel": kernel, "us": seconds * 1e6,
                                "weight_GBps": weight_bytes / seconds / 1e9})
                print(f"{name:13s} M={rows:4d} {kernel:40s} {seconds * 1e6:8.1f} us {weight_bytes / seconds / 1e9:7.0f} GB/s")
    report = {"benchmark": "fp8_linear", "command": "python -m treadle.bench.fp8_linear " + " ".join(sys.argv[1:]),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    output = Path(args.output) if args.output else (
        Path(__file__).resolve().parent / "results" / f"fp8_linear_{dt.date.today():%Y%m%d}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
