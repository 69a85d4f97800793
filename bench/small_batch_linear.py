"""Linear kernels at Llama-3.1-8B's projection shapes for decode-sized batches: device time per call, replayed
from CUDA graphs.

``python -m treadle.bench.small_batch_linear [--rows 1,16,32] [--weights bf16,fp8] [--explore] [--output PATH]``

Per shape (N x K, lm_head included) and number of rows M: bfloat16 ``F.linear`` (cuBLAS) and the Triton
small-batch kernel on bfloat16 weights (every config of ``SIXTEEN_BIT_CONFIGS``); FP8 W8A8 (per-token quantization
kernel + ``torch._scaled_mm``) and the Triton kernel on FP8 weights (``FP8_CONFIGS``). One-row GEMV configs run
at one row only, as the engine runs them. ``--explore`` times a wider grid of configs (to pick the lists). Each
line gives microseconds and weight bytes read per second; a summary per shape and M gives the winner, which is
what ``small_batch.choose`` picks at load.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import sys
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from treadle.bench.results_folder import results_dir

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336), "lm_head": (128256, 4096)}


def explore_configs(weight_bytes: int, rows: int = 1) -> list:
    """A grid around the shipped configs: tile sizes moving 4-16 KB of weight per loop step (for more than one
    row: ``tl.dot`` tiles of 4-32 KB with split-K; FP8 weights also as W8A8 tiles of up to 64 KB)."""
    from treadle.kernels.small_batch import SmallBatchConfig

    configs = []
    if rows > 1:
        for block_n, block_k, split_k in itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4)):
            if 4096 <= block_n * block_k * weight_bytes <= 32768:
                configs.append(SmallBatchConfig(block_n, block_k, 4, 4, split_k))
        if weight_bytes == 1:
            for block_n, block_k, split_k in itertools.product((32, 64, 128), (128, 256, 512), (1, 2, 4)):
                if 8192 <= block_n * block_k <= 65536:  # shared memory: 4 stages up to 32 KB tiles, then 3
                    stages = 4 if block_n * block_k <= 32768 else 3
                    configs.append(SmallBatchConfig(block_n, block_k, 4, stages, split_k, w8a8=True))
        return configs
    for block_n, block_k, split_k in itertools.product((8, 16, 32, 64), (64, 128, 256, 512, 1024), (1, 2, 4, 8)):
        if not 4096 <= block_n * block_k * weight_bytes <= 16384:
            continue
        configs += [SmallBatchConfig(block_n, block_k, warps, 3, split_k, gemv=True) for warps in (4, 8)]
        if block_n >= 16 and block_k <= 256:
            configs += [SmallBatchConfig(block_n, block_k, 4, stages, split_k) for stages in (3, 4)]
    return configs


def main(argv: Sequence[str] | None = None) -> int:
    from treadle.kernels.fp8_ops import fp8_matmul, quantize_per_channel, quantize_per_token
    from treadle.layers.small_batch import graph_seconds, weight_copies
    from treadle.kernels.small_batch import FP8_CONFIGS, SIXTEEN_BIT_CONFIGS, small_batch_matmul

    parser = argparse.ArgumentParser(prog="python -m treadle.bench.small_batch_linear")
    parser.add_argument("--rows", default="1,16,32")
    parser.add_argument("--weights", default="bf16,fp8")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--explore", action="store_true")
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")]
    kinds = args.weights.split(",")
    results, winners = [], []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        weight = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        wq, ws = quantize_per_channel(weight) if "fp8" in kinds else (None, None)
        # Each call reads another copy, so no weight is served from the L2 cache (as in a decode step).
        w16 = weight_copies(weight) if "bf16" in kinds else []
        w8 = weight_copies(wq) if "fp8" in kinds else []
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
            timings: dict[str, tuple[float, int]] = {}
            if "bf16" in kinds:
                timings["bf16 F.linear"] = (graph_seconds(lambda i: F.linear(x, w16[i % len(w16)])), 2 * n * k)
                for config in explore_configs(2, rows) if args.explore else SIXTEEN_BIT_CONFIGS:
                    if rows == 1 or not config.gemv:
                        seconds = _seconds(lambda i, config=config: small_batch_matmul(x, w16[i % len(w16)], None,
                                                                                      config))
                        timings[f"bf16 triton {config}"] = (seconds, 2 * n * k)
            if "fp8" in kinds:
                timings["fp8 w8a8 _scaled_mm"] = (
                    graph_seconds(lambda i: fp8_matmul(*quantize_per_token(x), w8[i % len(w8)], ws, torch.bfloat16)),
                    n * k)
                for config in explore_configs(1, rows) if args.explore else FP8_CONFIGS:
                    if rows == 1 or not config.gemv:
                        seconds = _seconds(lambda i, config=config: small_batch_matmul(x, w8[i % len(w8)], ws, config))
                        timings[f"fp8 triton {config}"] = (seconds, n * k)
            for kernel, (seconds, weight_bytes) in timings.items():
                results.append({"shape": name, "n": n, "k": k, "rows": rows, "kernel": kernel, "us": seconds * 1e6,
                                "weight_GBps": weight_bytes / seconds / 1e9})
                if not args.explore:
                    print(f"{name:13s} M={rows:3d} {kernel:42s} {seconds * 1e6:8.1f} us "
                          f"{weight_bytes / seconds / 1e9:7.0f} GB/s")
            for kind in kinds:
                mine = {kernel: value for kernel, value in timings.items() if kernel.startswith(kind)}
                library = next(kernel for kernel in mine if "triton" not in kernel)
                best = min(mine, key=lambda kernel: mine[kernel][0])
                winners.append({"shape": name, "rows": rows, "weights": kind, "library_us": mine[library][0] * 1e6,
                                "best": best, "best_us": mine[best][0] * 1e6,
                                "best_GBps": mine[best][1] / mine[best][0] / 1e9})
    print(f"\n{'shape':13s} {'M':>3s} {'weights':7s} {'library us':>10s} {'best us':>8s} {'GB/s':>6s}  best")
    for row in winners:
        print(f"{row['shape']:13s} {row['rows']:3d} {row['weights']:7s} {row['library_us']:10.1f} "
              f"{row['best_us']:8.1f} {row['best_GBps']:6.0f}  {row['best']}")
    report = {"benchmark": "small_batch_linear",
              "command": "python -m treadle.bench.small_batch_linear " + " ".join(sys.argv[1:]),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "winners": winners, "results": results}
    output = Path(args.output) if args.output else (
        results_dir() / f"small_batch_linear_{dt.date.today():%Y%m%d}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _seconds(run) -> float:
    """Like ``graph_seconds``, but a config that does not compile (too many registers, ...) is infinitely slow."""
    from treadle.layers.small_batch import graph_seconds

    try:
        return graph_seconds(run)
    except Exception:
        return float("inf")


if __name__ == "__main__":
    raise SystemExit(main())
