"""``python -m treadle.bench.lora_launches``: each LoRA gather launch alone at bs=32 over 32 slots of rank 16, per
Llama-3.1-8B projection (q/k/v, o, gate/up, down), for a grid of shrink blocks (rows 1-16, chunks 512-16384 of
``in``, 4-16 warps, 1-4 slices of ``in``, with and without the next chunk ahead) and expand blocks (32-1024 columns,
1-16 warps): microseconds a launch from a CUDA graph, 8 copies of the weights rotated so none is read from L2, and
the bytes' rate; prints the default's time and the best few per projection, writes every row as JSON. What
``LoRAKernelChoice``'s looped-shrink defaults were chosen from (about a minute on an H200).
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any, Callable, Sequence

import torch

T, S, R = 32, 32, 16
LAYERS = {"qkv": (4096, ((0, 4096), (4096, 5120), (5120, 6144))), "o": (4096, ((0, 4096),)),
          "gate_up": (4096, ((0, 14336), (14336, 28672))), "down": (14336, ((0, 4096),))}
COPIES, REPS = 8, 4


def graph_us(launch: Callable[[], None]) -> float:
    """Microseconds a kernel launch: ``launch()`` (COPIES launches) captured REPS times, replayed 10 times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        launch()
        launch()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPS):
            launch()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / (10 * REPS * COPIES)


def run() -> dict[str, list[dict[str, Any]]]:
    """Every shrink and expand candidate's row per projection, fastest first."""
    out: dict[str, list[dict[str, Any]]] = {"shrink": [], "expand": []}
    for name, (in_features, segments) in LAYERS.items():
        shrinks = _shrink_rows(name, in_features, len(segments) * R)
        expands = _expand_rows(name, len(segments) * R, segments)
        out["shrink"] += shrinks
        out["expand"] += expands
        torch.cuda.empty_cache()
    return out


def _shrink_candidates(rows: int, in_features: int) -> list[tuple[int, int, int, int, int, int]]:
    """``(block_r, block_k, warps, split, ahead, k_per_split)``: tiles of 2048-16384 elements, 4-64 a thread."""
    import triton

    found = []
    blocks = itertools.product((1, 2, 4, 8, 16), (512, 1024, 2048, 4096, 8192, 16384), (4, 8, 16), (1, 2, 4), (0, 1))
    for block_r, block_k, warps, split, ahead in blocks:
        tile = block_r * block_k
        if not 2048 <= tile <= 16384 or block_r > rows or block_k > triton.next_power_of_2(in_features):
            continue
        if warps * 32 * 4 > tile or tile // (warps * 32) > 64:
            continue
        k_per_split = triton.cdiv(triton.cdiv(in_features, split), block_k) * block_k
        if triton.cdiv(in_features, k_per_split) != split or (ahead and k_per_split <= block_k):
            continue
        found.append((block_r, block_k, warps, split, ahead, k_per_split))
    return found


def _shrink_rows(name: str, in_features: int, rows: int) -> list[dict[str, Any]]:
    import triton

    from treadle.kernels import lora

    dev = torch.device("cuda")
    ids = torch.arange(T, device=dev, dtype=torch.int32)
    x = torch.randn(T, in_features, device=dev, dtype=torch.bfloat16)
    copies = [torch.randn(S, rows, in_features, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
    scalings = torch.ones(rows // R, S, device=dev)
    ranks = torch.full((rows // R, S), R, device=dev, dtype=torch.int32)
    megabytes = S * rows * in_features * 2 / 1e6
    default = lora._gather_shrink_blocks(T, rows, in_features, True, lora.DEFAULT)
    default_launch = (*default[:5], default.warps or lora._gather_warps(default.block_r * default.block_k))
    results = []
    for block_r, block_k, warps, split, ahead, k_per_split in _shrink_candidates(rows, in_features):
        h = torch.empty(split, T, rows, device=dev, dtype=torch.float32)
        grid = (T, triton.cdiv(rows, block_r), split)

        def launch(block_r=block_r, block_k=block_k, warps=warps, ahead=ahead, k_per_split=k_per_split, h=h,
                   grid=grid) -> None:
            for a in copies:
                lora._shrink_gather_kernel[grid](
                    x, a, ids, scalings, ranks, h, T, in_features, R, rows, S, x.stride(0), x.stride(1), a.stride(0),
                    a.stride(1), a.stride(2), h.stride(0), h.stride(1), k_per_split, BLOCK_R=block_r,
                    BLOCK_K=block_k, FINAL=False, PDL=True, GO_AHEAD=True, AHEAD=ahead, launch_pdl=True,
                    num_warps=warps)

        us = graph_us(launch)
        results.append({"layer": name, "block_r": block_r, "block_k": block_k, "warps": warps, "split": split,
                        "ahead": ahead, "us": us, "tb_s": megabytes / us,
                        "default": (block_r, block_k, k_per_split, split, ahead, warps) == default_launch})
    return _report(f"{name} shrink ({megabytes:.1f} MB of A)", results,
                   lambda r: f"{r['block_r']} rows x {r['block_k']}, {r['warps']} warps, {r['split']} slices, "
                             f"ahead {r['ahead']}")


def _expand_rows(name: str, rows: int, segments: tuple[tuple[int, int], ...]) -> list[dict[str, Any]]:
    from treadle.kernels import lora
    from treadle.kernels.lora_tiles import segment_blocks

    dev = torch.device("cuda")
    ids = torch.arange(T, device=dev, dtype=torch.int32)
    width = segments[-1][1]
    copies = [torch.randn(S, width, R, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
    scalings = torch.ones(rows // R, S, device=dev)
    ranks = torch.full((rows // R, S), R, device=dev, dtype=torch.int32)
    h = torch.randn(1, T, rows, device=dev, dtype=torch.float32)
    out = torch.zeros(T, width, device=dev, dtype=torch.bfloat16)
    megabytes = S * width * R * 2 / 1e6
    default_n = lora._gather_expand_columns(T, width, max(e - s for s, e in segments), R, lora.DEFAULT)
    results = []
    for block_n, warps in itertools.product((32, 64, 128, 256, 512, 1024), (1, 2, 4, 8, 16)):
        if warps * 32 * 2 > block_n * R or block_n * R // (warps * 32) > 64:
            continue
        bounds, blocks = segment_blocks(segments, block_n)

        def launch(block_n=block_n, warps=warps, bounds=bounds, blocks=blocks) -> None:
            for b in copies:
                lora._expand_gather_kernel[(T, blocks)](
                    h, b, ids, scalings, ranks, out, T, R, S, h.stride(0), h.stride(1), h.stride(2), b.stride(0),
                    b.stride(1), b.stride(2), out.stride(0), out.stride(1), *bounds, BLOCK_N=block_n, BLOCK_R=R,
                    SPLIT=1, PARTIAL=True, PDL=True, GO_AHEAD=True, launch_pdl=True, num_warps=warps)

        us = graph_us(launch)
        results.append({"layer": name, "block_n": block_n, "warps": warps, "us": us, "tb_s": megabytes / us,
                        "default": (block_n, warps) == (default_n, lora._gather_warps(R * default_n))})
    return _report(f"{name} expand ({megabytes:.1f} MB of B)", results,
                   lambda r: f"{r['block_n']} columns, {r['warps']} warps")


def _report(title: str, results: list[dict[str, Any]],
            describe: Callable[[dict[str, Any]], str]) -> list[dict[str, Any]]:
    results.sort(key=lambda r: r["us"])
    default = next((r for r in results if r["default"]), None)
    print(f"{title}: {len(results)} candidates; default {default['us'] if default else float('nan'):.2f} us"
          + (f" ({describe(default)})" if default else ""), flush=True)
    for r in results[:5]:
        print(f"  {r['us']:6.2f} us  {r['tb_s']:5.2f} TB/s  {describe(r)}", flush=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treadle.bench.lora_launches", description=__doc__.split("\n")[0])
    parser.add_argument("--output", help="JSON path for every row")
    args = parser.parse_args(argv)
    rows = run()
    if args.output:
        with open(args.output, "w") as file:
            json.dump(rows, file, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
