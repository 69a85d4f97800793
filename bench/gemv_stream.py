"""``python -m treadle.bench.gemv_stream``: how fast the one-token W4A16 GEMV's loads alone stream Llama-3.1-8B's
packed weights, beside the GEMV itself with the same launch configs (the loader's), on one GPU (about 30 s).

The integer GEMV (``kernels/packed_int.py``) reads its packed words at ~2 TB/s, 34-50% of the roofline, whatever its
programs' shape (one to eight warps, one to four K steps a row: ``--trials gemv`` of ``bench/quant_sweep.py``), and a
loop with a third fewer instructions a value ran slower. Is the limit the loads' pattern (a few rows a program,
512-2048 bytes of each a step) or the work done on them? :func:`stream` makes exactly the GEMV's weight loads —
``block_n`` rows by ``block_w`` words a step, the next step's words loaded before this one's are used, 16 bytes a
load, split-K — and only adds the words as integers (one instruction a word, about a twentieth of the GEMV's).
Streaming near the copy bandwidth says the GEMV's arithmetic, activation and scale loads hold it; streaming at the
GEMV's rate says the pattern does. Prints per shape and config both rates and the GB/s of the packed words.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path
from typing import Sequence

import torch
import triton
import triton.language as tl

from treadle.bench.int_weights import SHAPES, PackedWeight, copy_bandwidth
from treadle.bench.results_folder import results_dir

GROUP = 128


@triton.jit
def _stream_kernel(w_ptr, out_ptr, N, words_per_split, stride_wn, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = w_ptr + offs_n[:, None] * stride_wn + tl.arange(0, BLOCK_W)[None, :]
    begin = pid_k * words_per_split
    end = begin + words_per_split
    words = tl.load(rows + tl.multiple_of(begin, 16), mask=n_mask[:, None], other=0, eviction_policy="evict_first")
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
    for w0 in range(begin, end, BLOCK_W):
        # The next step's words before this step's are used (the last step reloads its own), as the GEMV does.
        upcoming = tl.load(rows + tl.multiple_of(tl.minimum(w0 + BLOCK_W, end - BLOCK_W), 16), mask=n_mask[:, None],
                           other=0, eviction_policy="evict_first")
        acc += words
        words = upcoming
    tl.store(out_ptr + pid_k * N + offs_n, tl.sum(acc, axis=1), mask=n_mask)


def stream(words: torch.Tensor, block_n: int, block_w: int, split_k: int, num_warps: int) -> torch.Tensor:
    """``[split_k, N]`` int32: each row's words summed (wrapping) over each of ``split_k`` K ranges, loaded as the
    one-token GEMV loads them with these launch parameters (``IntTiles``' of ``kernels/packed_int.py``)."""
    n, width = words.shape
    if width % (block_w * split_k):
        raise ValueError(f"{width} words a row do not split into {split_k} ranges of whole {block_w}-word steps")
    out = torch.empty(split_k, n, dtype=torch.int32, device=words.device)
    _stream_kernel[(triton.cdiv(n, block_n), split_k)](words, out, n, width // split_k, words.stride(0),
                                                      BLOCK_N=block_n, BLOCK_W=block_w, num_warps=num_warps)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from treadle.kernels.int_kernel_plan import run_tiles
    from treadle.kernels.packed_int import gemv_candidates
    from treadle.layers.small_batch import graph_seconds

    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"device-to-device copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + write)")
    rows = []
    for name, (n, k) in SHAPES.items():
        weight = PackedWeight(n, k, False, device)
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        packed_bytes = weight.words[0].numel() * 4
        for tiles in [t for t in gemv_candidates(n, k, 4, sm_count) if t.subnormal]:
            stream_s = graph_seconds(lambda i, t=tiles: stream(weight.words[i % len(weight.words)], t.block_n,
                                                               t.block_w, t.split_k, t.num_warps))
            gemv_s = graph_seconds(lambda i, t=tiles: run_tiles(x, weight.words[i % len(weight.words)],
                                                                weight.scales, None, 4, GROUP, t))
            row = {"shape": name, "n": n, "k": k, "tiles": str(tiles), "stream_us": stream_s * 1e6,
                   "gemv_us": gemv_s * 1e6, "stream_GBps": packed_bytes / stream_s / 1e9,
                   "gemv_GBps": packed_bytes / gemv_s / 1e9}
            rows.append(row)
            print(f"{name:<13} {tiles.block_n:>3} rows x {tiles.block_w:>3} words, split {tiles.split_k}, "
                  f"{tiles.num_warps} warps: loads alone {row['stream_us']:6.1f} us {row['stream_GBps']:5.0f} GB/s, "
                  f"the GEMV {row['gemv_us']:6.1f} us {row['gemv_GBps']:5.0f} GB/s")
    path = Path(args.output) if args.output else results_dir() / f"gemv_stream_{dt.date.today():%Y%m%d}.json"
    path.write_text(json.dumps({"benchmark": "gemv_stream", "date": dt.datetime.now().isoformat(timespec="seconds"),
                                "gpu": torch.cuda.get_device_name(device), "copy_bandwidth_GBps": bandwidth / 1e9,
                                "results": rows}, indent=2))
    print(f"wrote {path}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m treadle.bench.gemv_stream", description=__doc__.split("\n")[0])
    parser.add_argument("--output", help="JSON path (default: the results folder)")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
