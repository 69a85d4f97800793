"""The integer-weight kernels (kernels/packed_int.py) at Llama-3.1-8B's projection shapes against bf16, on one GPU:
``python -m treadle.bench.quant_kernels [--rows 1,8,32] [--explore] [--moe] [--output PATH]`` (about a minute on an
H100); ``--sweep`` times every variant, ``kernels/packed_int_mma.py``'s too (``bench/quant_sweep.py``).

Per shape (qkv, o, gate_up, down) and rows M: bfloat16 ``F.linear`` (cuBLAS) on the same shape, and every launch
config the loader would time for W4A16 (compressed-tensors' symmetric groups of 128; ``--zeros`` adds AWQ-style
zero points), each replayed from a CUDA graph with the weight cycled through copies so it is read from memory as a
decode step reads it. Each line: microseconds, the speed-up over bf16, and the fraction of the W4A16 roofline
(bytes of the packed weight, its scales and zeros, the activations and the output, at the measured copy bandwidth).
The summary adds the four shapes up per decoder layer (what a decode step spends in its linear layers, times 32
layers) with the fastest config of each, as the loader picks them. ``--explore`` times a wider grid of configs;
``--moe`` adds one Mixtral-8x7B MoE layer (16-bit fused experts against every form of W4A16 ones, per token
count: ``bench/quant_moe.py``), ``--moe-only`` runs only that. ``--large`` times large batches instead
(``bench/quant_large.py``: the dequantize-then-matmul path, the dequantization alone against the copy bandwidth, and
the ``tl.dot`` kernels and ``wide_mma``, against bf16 at 128, 256, 512 and 1024 rows).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from treadle.bench.int_weights import LAYERS, SHAPES, PackedWeight, candidates, copies, copy_bandwidth
from treadle.bench.quant_large import large_batch
from treadle.bench.quant_moe import MOE_TOKENS, moe_rows
from treadle.bench.quant_sweep import sweep
from treadle.bench.results_folder import results_dir


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.sweep:
        rows = "1,4,8,16,32,64" if args.rows is None else args.rows
        return sweep([int(r) for r in rows.split(",")], args.jobs, args.zeros, args.output, narrow=args.narrow,
                     only=args.trials)
    from treadle.layers.small_batch import graph_seconds

    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    if args.large:
        rows = [int(r) for r in (args.rows or "128,256,512,1024").split(",")]
        return _write(args, bandwidth, large_batch(rows, args.zeros, bandwidth, device, graph_seconds))
    rows_list = [int(r) for r in (args.rows or "1,8,32").split(",")]
    results = []
    for name, (n, k) in ({} if args.moe_only else SHAPES).items():
        weight = PackedWeight(n, k, args.zeros, device)
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.01
        dense_copies = copies(dense)
        for rows in rows_list:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            bf16_s = graph_seconds(lambda i: F.linear(x, dense_copies[i % len(dense_copies)]))
            roofline_s = (weight.bytes + 2 * rows * (n + k)) / bandwidth
            for tiles in candidates(n, k, rows, device, args.explore):
                try:
                    seconds = graph_seconds(lambda i, tiles=tiles: weight.run(x, i, tiles))
                except Exception as exc:  # a config that does not compile here is reported, not fatal
                    print(f"{name} M={rows} {tiles}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                results.append({"shape": name, "n": n, "k": k, "rows": rows, "tiles": str(tiles),
                                "us": seconds * 1e6, "bf16_us": bf16_s * 1e6, "speedup": bf16_s / seconds,
                                "roofline_fraction": roofline_s / seconds})
                print(f"{name:<13} M={rows:<3} {seconds * 1e6:8.1f} us  bf16 {bf16_s * 1e6:8.1f} us  "
                      f"{bf16_s / seconds:5.2f}x  {roofline_s / seconds:5.0%} of roofline  {tiles}")
    if results:
        print()
        print(summary(results, rows_list))
    moe_tokens = [int(t) for t in args.moe_tokens.split(",")]
    moe = moe_rows(moe_tokens, bandwidth, device, args.zeros) if args.moe or args.moe_only else []
    return _write(args, bandwidth, {"results": results, "moe": moe})


def _write(args: argparse.Namespace, bandwidth: float, results: dict) -> int:
    report = {"benchmark": "quant_kernels", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9, "zeros": args.zeros,
              **results}
    suffix = "_large" if args.large else ""
    output = (Path(args.output) if args.output
              else results_dir() / f"quant_kernels{suffix}_{dt.date.today():%Y%m%d}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


def summary(results: list[dict], rows_list: list[int]) -> str:
    """Per rows: each shape's fastest config, and the four shapes' sum times the layers against bf16."""
    lines = [f"{'':<22}{'bf16 us':>9}{'w4a16 us':>10}{'speed-up':>10}{'roofline':>10}  fastest config"]
    for rows in rows_list:
        layer_bf16 = layer_w4 = 0.0
        for shape in SHAPES:
            timed = [r for r in results if r["shape"] == shape and r["rows"] == rows]
            if not timed:
                continue
            best = min(timed, key=lambda r: r["us"])
            layer_bf16 += best["bf16_us"]
            layer_w4 += best["us"]
            lines.append(f"{shape + f' M={rows}':<22}{best['bf16_us']:>9.1f}{best['us']:>10.1f}"
                         f"{best['speedup']:>9.2f}x{best['roofline_fraction']:>9.0%}  {best['tiles']}")
        if layer_w4:
            lines.append(f"{f'x{LAYERS} layers M={rows}':<22}{layer_bf16 * LAYERS / 1e3:>8.2f}m"
                         f"{layer_w4 * LAYERS / 1e3:>9.2f}m{layer_bf16 / layer_w4:>9.2f}x  (ms of linear layers per "
                         "decode step)")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m treadle.bench.quant_kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", help="batch sizes, comma-separated (default 1,8,32; with --sweep 1,4,8,16,32,64)")
    parser.add_argument("--sweep", action="store_true",
                        help="every kernel variant and config, int_mma's included (bench/quant_sweep.py)")
    parser.add_argument("--narrow", action="store_true",
                        help="--sweep: only what the loader times and round 2's trials (about 40 s on an H100)")
    parser.add_argument("--trials", choices=("all", "natural", "gemv"), default="all",
                        help="--sweep --narrow: every kind's trials, natural_mma's alone "
                             "(kernels/packed_int_natural.py), or the one-token GEMV's wide programs alone")
    parser.add_argument("--jobs", type=int, default=max((os.cpu_count() or 4) - 2, 1),
                        help="--sweep: processes compiling the configs first (default: all cores but two)")
    parser.add_argument("--zeros", action="store_true", help="asymmetric weights with zero points (AWQ's layout)")
    parser.add_argument("--explore", action="store_true", help="time a wider grid of launch configs")
    parser.add_argument("--moe", action="store_true",
                        help="also one Mixtral-8x7B MoE layer, 16-bit against every W4A16 form (bench/quant_moe.py)")
    parser.add_argument("--moe-only", action="store_true", help="only the MoE layer (about 2 minutes on an H100)")
    parser.add_argument("--moe-tokens", default=MOE_TOKENS, help=f"MoE token counts (default {MOE_TOKENS})")
    parser.add_argument("--large", action="store_true",
                        help="large batches instead (bench/quant_large.py): dequantize alone, dequantize + matmul "
                             "and the tl.dot kernels against bf16 (--rows default 128,256,512)")
    parser.add_argument("--output")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
