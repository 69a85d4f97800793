"""W4A16 at large batches (``python -m treadle.bench.quant_kernels --large [--rows 128,256,512,1024]``): what a
batch above 64 rows can run (``kernels/packed_int_wide.py``'s ``wide_mma``, the weight widened in registers, and
``kernels/int_kernel_plan.py``'s ``dequantize_linear``: the weight dequantized to bf16, then cuBLAS) against bf16
``F.linear`` at Llama-3.1-8B's projection shapes, on one GPU.

Per shape: ``dequantize`` alone for each launch config of ``dequantize_candidates`` (microseconds, and GB/s of the
packed weight and scales read plus the 16-bit weight written, against the measured copy bandwidth; the default's
and the fastest's printed, every config's in the JSON); then per rows (default 128, 256, 512) bf16 ``F.linear``,
the dequantize-then-matmul path with the default config (what runs) and with the fastest, and the ``tl.dot``
kernels the loader times at 64 rows (``magic_mma``'s first): whether raising ``DOT_MAX_ROWS`` (256) would win, and
what the loader's race at 128 and 256 rows (``dot_max_rows``) sees (up to 256 rows: they lost 2-4x there), and
each ``wide_mma`` launch the loader times at those rows (``wide_candidates``: its first's and fastest's
microseconds). The summary adds the shapes up per decoder layer times 32 (ms of linear layers a step), with the
loader's pick per shape (the faster of ``wide_mma``'s fastest and the dequantize path). Each timing replays a CUDA
graph, the weights cycled through copies (read from memory).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from treadle.bench.int_weights import LAYERS, SHAPES, PackedWeight, copies

GROUP = 128


def large_batch(rows_list: list[int], zeros: bool, bandwidth: float, device: torch.device,
                seconds: Callable[[Callable[[int], Any]], float]) -> dict:
    """The large-batch timings (module docstring) as ``{"dequantize": [...], "matmul": [...]}``, printed as they
    come; ``seconds(run)`` times ``run(i)`` (``layers/small_batch.py``'s ``graph_seconds``)."""
    from treadle.kernels.int_kernel_plan import dequantize_linear
    from treadle.kernels.packed_int_dequant import DequantBuffer, DequantTiles, dequantize, dequantize_candidates

    dequantized, matmuls = [], []
    buffer = DequantBuffer(device)  # the model's layers share one per device
    for name, (n, k) in SHAPES.items():
        weight = PackedWeight(n, k, zeros, device)
        out = torch.empty(n, k, dtype=torch.bfloat16, device=device)
        moved = weight.bytes + out.numel() * 2
        timed = {}
        for tiles in dequantize_candidates():
            timed[tiles] = seconds(lambda i, tiles=tiles: dequantize(
                weight.words[i % len(weight.words)], weight.scales, weight.zeros, None, 4, GROUP, torch.bfloat16,
                out, tiles))
            dequantized.append({"shape": name, "tiles": str(tiles), "us": timed[tiles] * 1e6,
                                "GBps": moved / timed[tiles] / 1e9, "bandwidth_fraction": moved / timed[tiles] /
                                bandwidth})
        best = min(timed, key=timed.get)
        print(f"dequantize {name:<13} " + "  ".join(
            f"{label} {timed[tiles] * 1e6:7.1f} us {moved / timed[tiles] / 1e9:5.0f} GB/s "
            f"{moved / timed[tiles] / bandwidth:4.0%}" for label, tiles in (("default", DequantTiles()),
                                                                           ("best", best))) + f"  {best}")
        dense = copies(torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.01)
        for rows in rows_list:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            row = {"shape": name, "n": n, "k": k, "rows": rows,
                   "bf16_us": 1e6 * seconds(lambda i: F.linear(x, dense[i % len(dense)])),
                   "path_us": 1e6 * seconds(lambda i: dequantize_linear(
                       x, weight.words[i % len(weight.words)], weight.scales, weight.zeros, None, 4, GROUP,
                       buffer=buffer)),
                   "dequantize_us": timed[DequantTiles()] * 1e6, "best_dequantize": str(best),
                   "best_path_us": 1e6 * seconds(lambda i: F.linear(x, dequantize(
                       weight.words[i % len(weight.words)], weight.scales, weight.zeros, None, 4, GROUP,
                       torch.bfloat16, out, best)))}
            if rows <= 256:
                row.update(_dot_kernels(x, weight, n, k, device, seconds))
            row.update(_wide_kernels(x, weight, n, k, device, seconds))
            row["kept_us"] = min(row["path_us"], row.get("wide_best_us", row["path_us"]))
            matmuls.append(row)
            print(_matmul_line(row))
    print()
    print(summary(matmuls, rows_list))
    return {"dequantize": dequantized, "matmul": matmuls}


def _dot_kernels(x: torch.Tensor, weight: PackedWeight, n: int, k: int, device: torch.device,
                 seconds: Callable[[Callable[[int], Any]], float]) -> dict:
    """The ``tl.dot`` launches the loader times at 64 rows (the first runs untimed), at ``x``'s rows: the first's
    and the fastest's microseconds."""
    from treadle.kernels.int_kernel_plan import batch_candidates

    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    timed = {}
    for tiles in batch_candidates(n, k, 4, GROUP, 64, sm_count, torch.bfloat16):
        try:
            timed[str(tiles)] = seconds(lambda i, tiles=tiles: weight.run(x, i, tiles))
        except Exception as exc:  # a launch that does not run this shape is reported, not fatal
            print(f"  {tiles}: {type(exc).__name__}: {str(exc)[:160]}")
    if not timed:
        return {}
    first, best = next(iter(timed)), min(timed, key=timed.get)
    return {"dot_first_us": timed[first] * 1e6, "dot_first": first, "dot_best_us": timed[best] * 1e6,
            "dot_best": best}


def _wide_kernels(x: torch.Tensor, weight: PackedWeight, n: int, k: int, device: torch.device,
                  seconds: Callable[[Callable[[int], Any]], float]) -> dict:
    """The ``wide_mma`` launches the loader times at ``x``'s rows: each one's microseconds, the first's and the
    fastest's."""
    from treadle.kernels.packed_int_wide import wide_candidates

    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    timed = {}
    for tiles in wide_candidates(n, k, 4, GROUP, x.shape[0], sm_count):
        try:
            timed[str(tiles)] = seconds(lambda i, tiles=tiles: weight.run(x, i, tiles))
        except Exception as exc:  # reported, not fatal
            print(f"  {tiles}: {type(exc).__name__}: {str(exc)[:160]}")
    if not timed:
        return {}
    first, best = next(iter(timed)), min(timed, key=timed.get)
    return {"wide_first_us": timed[first] * 1e6, "wide_best_us": timed[best] * 1e6, "wide_best": best,
            "wide_us": {name: t * 1e6 for name, t in timed.items()}}


def _matmul_line(row: dict) -> str:
    line = (f"{row['shape']:<13} M={row['rows']:<4} bf16 {row['bf16_us']:8.1f} us  dequantize+matmul "
            f"{row['path_us']:8.1f} us ({row['bf16_us'] / row['path_us']:4.2f}x; best config "
            f"{row['best_path_us']:8.1f})")
    if "dot_best_us" in row:
        line += (f"  tl.dot first {row['dot_first_us']:8.1f} best {row['dot_best_us']:8.1f} us "
                 f"({row['bf16_us'] / row['dot_best_us']:4.2f}x) {row['dot_best']}")
    if "wide_best_us" in row:
        line += (f"\n{'':<20}wide_mma first {row['wide_first_us']:8.1f} best {row['wide_best_us']:8.1f} us "
                 f"({row['bf16_us'] / row['wide_best_us']:4.2f}x bf16) {row['wide_best']}")
    return line


def summary(matmuls: list[dict], rows_list: list[int]) -> str:
    """Per rows, the four shapes' sum times the layers: bf16, the dequantization alone, the whole path (default and
    fastest config), the ``tl.dot`` kernels' fastest, ``wide_mma``'s fastest, and the loader's pick per shape (the
    faster of ``wide_mma`` and the path), in ms of linear layers a step."""
    lines = [f"{'x' + str(LAYERS) + ' layers':<16}{'bf16':>9}{'dequant':>9}{'path':>9}{'best':>9}{'tl.dot':>9}"
             f"{'wide':>9}{'kept':>9}  (ms a step; path/bf16, kept/bf16)"]
    for rows in rows_list:
        picked = [row for row in matmuls if row["rows"] == rows]
        total = {key: sum(row.get(key, 0.0) for row in picked) * LAYERS / 1e3
                 for key in ("bf16_us", "dequantize_us", "path_us", "best_path_us", "dot_best_us", "wide_best_us",
                             "kept_us")}
        dot, wide = (f"{total[key]:>9.2f}" if all(key in row for row in picked) else f"{'-':>9}"
                     for key in ("dot_best_us", "wide_best_us"))
        kept = total["kept_us"] or total["path_us"]
        lines.append(f"{f'M={rows}':<16}{total['bf16_us']:>9.2f}{total['dequantize_us']:>9.2f}"
                     f"{total['path_us']:>9.2f}{total['best_path_us']:>9.2f}{dot}{wide}{kept:>9.2f}  "
                     f"({total['path_us'] / total['bf16_us']:.2f}x, {kept / total['bf16_us']:.2f}x the bf16 time)")
    return "\n".join(lines)
