"""``python -m treadle.bench.quant_kernels --sweep [--rows 1,4,8,16,32,64] [--jobs N] [--narrow]``: every W4A16
kernel variant and launch config (the GEMV and ``int_dot`` configs, the ``int_mma`` candidates of
``kernels/packed_int_mma.py`` and the ``magic_mma`` ones of ``kernels/packed_int_magic.py``) at
Llama-3.1-8B's four projection shapes and each batch size, against bfloat16 ``F.linear`` and the W4A16 roofline, on
one GPU (about 3 minutes on an H100). ``--narrow``: only the launches the
loader times (``kernels/int_kernel_plan.py``) and the trials (:func:`trials`, :func:`magic_trials`); ``--trials
natural``: only ``kernels/packed_int_natural.py``'s trials beside what the loader times (about 3 minutes at rows
16, 32 and 64 on an H200).

The configs compile first in ``--jobs`` processes at once (filling Triton's on-disk cache), then each is timed alone
from a CUDA graph with the weight cycled through copies (read from memory, as a decode step reads it), after its
output is checked against the dequantized weight's bf16 matmul (a config off by more than bf16 rounding is
printed as WRONG and never ranked). Prints, per shape and rows, the fastest config of today's kernels and of all,
with its speed-up over bf16 and fraction of the roofline, and per rows the four shapes times 32 layers; then each
kernel's fastest per shape and its 32-layer sum (:func:`kernel_table`); writes every timing as JSON.
"""

from __future__ import annotations

import datetime as dt
import json
import multiprocessing
from pathlib import Path

import torch
import torch.nn.functional as F

from treadle.bench.int_weights import LAYERS, SHAPES, PackedWeight, candidates, copies, copy_bandwidth
from treadle.bench.results_folder import results_dir

GROUP = 128
MAX_ERROR = 1e-2  # relative to the dequantized weight's bf16 matmul: bf16 rounding passes, a wrong layout does not


def sweep(rows_list: list[int], jobs: int, zeros: bool, output: str | None, device: str = "cuda",
          narrow: bool = False, only: str = "all") -> int:
    from treadle.kernels.packed_int_dequant import dequantize
    from treadle.layers.small_batch import graph_seconds

    device = torch.device(device)

    def listing(n: int, k: int, rows: int, device: torch.device) -> list[tuple[str, object]]:
        return narrow_variants(n, k, rows, device, only) if narrow else variants(n, k, rows, device)

    work = [(name, rows, kernel, tiles) for name in SHAPES for rows in rows_list
            for kernel, tiles in listing(*SHAPES[name], rows, device)]
    if jobs > 1:
        # --narrow compiles every row bucket's launches the loader times, timed or not: a model loaded after the
        # sweep (bench/quant.py) finds them in Triton's cache instead of compiling them one by one.
        compiled = work if not narrow else [(name, rows, kernel, tiles) for name in SHAPES
                                            for rows in sorted(set(rows_list) | {1, 16, 32, 64})
                                            for kernel, tiles in listing(*SHAPES[name], rows, device)]
        _precompile(compiled, jobs, zeros, timed=work)
    bandwidth = copy_bandwidth(device)
    path = Path(output) if output else results_dir() / f"quant_kernels_sweep_{dt.date.today():%Y%m%d}.json"
    results, bf16 = [], {}
    for name, (n, k) in SHAPES.items():
        weight = PackedWeight(n, k, zeros, device)
        dense_copies = copies(torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.01)
        for rows in rows_list:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            bf16[name, rows] = graph_seconds(lambda i: F.linear(x, dense_copies[i % len(dense_copies)]))
            roofline_s = (weight.bytes + 2 * rows * (n + k)) / bandwidth
            expected = F.linear(x, dequantize(weight.words[0], weight.scales, weight.zeros, None, 4, GROUP, x.dtype))
            for shape, r, kernel, tiles in work:
                if (shape, r) != (name, rows):
                    continue
                try:
                    error = _error(weight.run(x, 0, tiles), expected)
                    seconds = graph_seconds(lambda i, tiles=tiles: weight.run(x, i, tiles))
                except Exception as exc:  # a config that does not compile or fit here is reported, not fatal
                    print(f"{name} M={rows} {kernel} {tiles}: {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                if error > MAX_ERROR:
                    print(f"{name} M={rows} {kernel} {tiles}: WRONG, relative error {error:.2e}")
                results.append({"shape": name, "n": n, "k": k, "rows": rows, "kernel": kernel, "tiles": str(tiles),
                                "us": seconds * 1e6, "bf16_us": bf16[name, rows] * 1e6,
                                "speedup": bf16[name, rows] / seconds, "roofline_fraction": roofline_s / seconds,
                                "error": error, "correct": error <= MAX_ERROR})
            timed = [r for r in results if (r["shape"], r["rows"]) == (name, rows) and r["correct"]]
            if timed:
                best = min(timed, key=lambda r: r["us"])
                print(f"{name} M={rows}: {len(timed)} configs, best {best['us']:.1f} us ({best['speedup']:.2f}x bf16)")
        _write(path, results, bandwidth, zeros)  # a sweep cut short keeps the shapes it finished
    print(table(results, rows_list))
    print(kernel_table(results, rows_list))
    print(f"wrote {_write(path, results, bandwidth, zeros)}")
    return 0


def variants(n: int, k: int, rows: int, device: torch.device) -> list[tuple[str, object]]:
    """``(kernel, tiles)`` pairs to time for a batch of ``rows``: the GEMV's wider grid (``--explore``'s: rows per
    program, words per step, split-K, warps) for one row, else ``int_dot``'s configs (``bench/int_weights.py``'s
    ``candidates``), then the ``int_mma`` candidates, :func:`magic_trials` and :func:`natural_trials`."""
    from treadle.kernels.packed_int_mma import mma_candidates

    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    today = [(_kernel(tiles), tiles) for tiles in candidates(n, k, rows, device, rows == 1)]
    return today + [("int_mma", tiles) for tiles in mma_candidates(n, k, 4, GROUP, rows, sm_count)] + \
        [(_kernel(tiles), tiles) for tiles in magic_trials(n, k, rows, sm_count) +
         natural_trials(n, k, rows, sm_count)]


def narrow_variants(n: int, k: int, rows: int, device: torch.device, only: str = "all") -> list[tuple[str, object]]:
    """``--narrow``: what the loader times for a batch of ``rows`` (``kernels/int_kernel_plan.py``: the GEMV's
    configs at one row, else its row bucket's ``magic_mma``, ``natural_mma``, ``int_mma`` and ``int_dot``
    launches), then the trials that test the hypotheses of what holds the kernels below their roofline
    (:func:`trials`, :func:`magic_trials`, :func:`natural_trials`; ``only="natural"``: the last alone)."""
    from treadle.kernels.int_kernel_plan import batch_candidates
    from treadle.kernels.packed_int import gemv_candidates

    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    bucket = 16 if rows <= 16 else 32 if rows <= 32 else 64
    loader = gemv_candidates(n, k, 4, sm_count) if rows == 1 else batch_candidates(n, k, 4, GROUP, bucket, sm_count,
                                                                                   torch.bfloat16)
    if only == "gemv":
        listed = wide_gemv_trials(n, k, rows, sm_count)
    else:
        listed = natural_trials(n, k, rows, sm_count)
    if only == "all":
        listed = trials(n, k, rows, sm_count) + magic_trials(n, k, rows, sm_count) + listed
    tried = [t for t in dict.fromkeys(listed) if t not in loader]
    return [(_kernel(tiles), tiles) for tiles in dict.fromkeys(loader)] + \
        [(f"{_kernel(tiles)} trial", tiles) for tiles in tried]


def trials(n: int, k: int, rows: int, sm_count: int) -> list:
    """Launches no loader times yet. One row: GEMV programs that load two panels (128 words) of 4 or 8 rows a step,
    and the best config's split-K doubled: are qkv and o_proj (few rows, 35-42% of the roofline) short of bytes in
    flight per SM? 16 and 32 rows: per-slot dots on 128-row tiles of one or two warpgroups, split-K for one or two
    programs per SM (per-slot dots alternating between two accumulators, ``two_chains``, lost to the loader's
    ``int_mma`` launches at every shape on an H200 and were removed; commit ``178d66b`` has them)."""
    from treadle.kernels.packed_int import IntTiles, _split
    from treadle.kernels.packed_int_mma import MmaTiles, _split as _mma_split

    words = k // 8
    if rows == 1:
        listed = [IntTiles(0, block_n, 128, _split(n, words, block_n, 128, 12 * sm_count) * more, 1)
                  for block_n in (4, 8) for more in (1, 2)]
        listed.append(IntTiles(0, 8, 64, 2 * _split(n, words, 8, 64, 12 * sm_count), 1))
        return [t for t in listed if words % (t.split_k * t.block_w) == 0]
    if rows > 32:
        return []
    block_m, steps, listed = 16 if rows <= 16 else 32, k // 128, []
    for warps in (4, 8):
        for programs in (1, 2):
            split = _mma_split(n, steps, 128, programs * sm_count)
            listed.append(MmaTiles(block_m, 128, split_k=split, num_warps=warps, per_slot=True))
    return [t for t in listed if t.fits(k, 4, GROUP)]


def magic_trials(n: int, k: int, rows: int, sm_count: int) -> list:
    """The candidates that widen with fewer instructions: kernels/packed_int_magic.py's tensor-core kernel at 2 to 64
    rows (each weight tile widened once a program, by pairs: does M=32 then cost about what M=16 does?; at one row
    on a 16-token tile it lost to every GEMV in round 1, 1.33x bf16 against 1.94x, and is no longer timed there).
    The GEMV's subnormal widening (``IntTiles.subnormal``), once a trial here, is in the loader's configs
    (``gemv_candidates``), so every sweep times it as today's ``gemv_subnormal``."""
    from treadle.kernels.packed_int_magic import mma_trials

    return mma_trials(n, k, rows, sm_count) if rows > 1 else []


def wide_gemv_trials(n: int, k: int, rows: int, sm_count: int) -> list:
    """One row: GEMV programs of 2 to 8 warps whose step is 256 or 512 words a row (the whole K range of a 4096-wide
    split in one or two steps, 4 to 32 words a thread): every load of a program issued at once, so a program waits
    for memory once, not once per step. Do the small shapes (qkv, o_proj: 4 steps a row in the loader's 1-warp
    programs) then come nearer their roofline?"""
    import triton

    from treadle.kernels.packed_int import IntTiles

    if rows != 1:
        return []
    words = k // 8
    return [IntTiles(0, block_n, block_w, split, warps, subnormal=True)
            for block_n in (4, 8, 16) for block_w in (256, 512) for warps in (2, 4, 8) for split in (1, 2, 4)
            if words % (block_w * split) == 0 and 4 <= block_n * block_w // (32 * warps) <= 32
            and triton.cdiv(n, block_n) * split >= sm_count]


def natural_trials(n: int, k: int, rows: int, sm_count: int) -> list:
    """kernels/packed_int_natural.py's tensor-core kernel at 2 to 64 rows (the widened panel in natural K order, one
    dot a panel whose wgmmas do not wait for each other, the activations copied straight into the MMA's shared
    layout): do M=16, 32 and 64 then run near the packed weight's roofline, under bf16 at every shape?"""
    from treadle.kernels.packed_int_natural import natural_trials as listed

    return listed(n, k, rows, sm_count) if rows > 1 else []


def _kernel(tiles) -> str:
    from treadle.kernels.packed_int_magic import MagicMmaTiles
    from treadle.kernels.packed_int_mma import MmaTiles
    from treadle.kernels.packed_int_natural import NaturalMmaTiles

    if isinstance(tiles, MagicMmaTiles):
        return "magic_mma"
    if isinstance(tiles, NaturalMmaTiles):
        return "natural_mma"
    if isinstance(tiles, MmaTiles):
        return "int_mma"
    if tiles.block_m:
        return "int_dot"
    return "gemv_subnormal" if tiles.subnormal else "gemv"


def table(results: list[dict], rows_list: list[int]) -> str:
    """Per shape and rows: bf16, the fastest of today's kernels, the fastest of all (speed-up, roofline, config);
    per rows the four shapes' sum times the layers."""
    lines = [f"{'':<20}{'bf16 us':>9}{'today us':>10}{'best us':>9}{'speed-up':>10}{'roofline':>10}  best config"]
    for rows in rows_list:
        step = {"bf16": 0.0, "today": 0.0, "best": 0.0}
        for shape in SHAPES:
            timed = [r for r in results if r["shape"] == shape and r["rows"] == rows and r.get("correct", True)]
            # Today's kernels: what the loader times (a --narrow sweep's launches but its trials), else all but
            # the candidates (int_mma's, the magic kernels').
            narrow = any(r["kernel"].endswith("trial") for r in timed)
            today = [r for r in timed if not (r["kernel"].endswith("trial") if narrow else r["kernel"] == "int_mma"
                                              or r["kernel"].startswith(("magic", "natural")))]
            if not timed or not today:
                continue
            best, best_today = min(timed, key=lambda r: r["us"]), min(today, key=lambda r: r["us"])
            step["bf16"] += best["bf16_us"]
            step["today"] += best_today["us"]
            step["best"] += best["us"]
            lines.append(f"{shape + f' M={rows}':<20}{best['bf16_us']:>9.1f}{best_today['us']:>10.1f}"
                         f"{best['us']:>9.1f}{best['speedup']:>9.2f}x{best['roofline_fraction']:>9.0%}  "
                         f"{best['kernel']} {best['tiles']}")
        if step["best"]:
            lines.append(f"{f'x{LAYERS} layers M={rows}':<20}{step['bf16'] * LAYERS / 1e3:>8.2f}m"
                         f"{step['today'] * LAYERS / 1e3:>9.2f}m{step['best'] * LAYERS / 1e3:>8.2f}m"
                         f"{step['bf16'] / step['best']:>9.2f}x  (ms of linear layers per decode step; today "
                         f"{step['bf16'] / step['today']:.2f}x)")
    return "\n".join(lines)


def kernel_table(results: list[dict], rows_list: list[int]) -> str:
    """Per rows, each kernel's fastest config per shape and the four shapes times the layers (a kernel missing a
    shape is left out of the sum), against bf16: which kernel to wire in where."""
    lines = [f"{'per kernel':<14}{'rows':>5}" + "".join(f"{shape:>14}" for shape in SHAPES)
             + f"{'x32 ms':>9}{'vs bf16':>9}"]
    for rows in rows_list:
        timed = [r for r in results if r["rows"] == rows and r.get("correct", True)]
        bf16 = {r["shape"]: r["bf16_us"] for r in timed}
        for kernel in sorted({r["kernel"].removesuffix(" trial") for r in timed}):
            best = {shape: min((r["us"] for r in timed if r["shape"] == shape
                                and r["kernel"].removesuffix(" trial") == kernel), default=None) for shape in SHAPES}
            cells = "".join(f"{us:>14.1f}" if us else f"{'-':>14}" for us in best.values())
            if all(best.values()) and len(bf16) == len(SHAPES):
                step, base = sum(best.values()), sum(bf16.values())
                cells += f"{step * LAYERS / 1e3:>9.2f}{base / step:>8.2f}x"
            lines.append(f"{kernel:<14}{rows:>5}{cells}")
    return "\n".join(lines)


def _error(y: torch.Tensor, expected: torch.Tensor) -> float:
    return ((y.float() - expected.float()).norm() / expected.float().norm()).item()


def _write(path: Path, results: list[dict], bandwidth: float, zeros: bool) -> Path:
    report = {"benchmark": "quant_kernels_sweep",
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "copy_bandwidth_GBps": bandwidth / 1e9, "zeros": zeros,
              "group": GROUP, "results": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def precompile_loader(jobs: int, zeros: bool) -> None:
    """Compile what the loader times at Llama-3.1-8B's shapes (bf16 activations, groups of 128; ``zeros``: with
    zero points) in ``jobs`` processes, so that a model loaded next (bench/quant.py ``--precompile``) finds every
    launch in Triton's cache instead of compiling them one by one."""
    from treadle.kernels.int_kernel_plan import SiluMulTiles, batch_candidates
    from treadle.kernels.packed_int import gemv_candidates
    from treadle.kernels.packed_int_dequant import load_dequantize_candidates
    from treadle.kernels.packed_int_natural import NaturalMmaTiles
    from treadle.kernels.packed_int_wide import WIDE_BUCKETS, wide_candidates

    sm_count = torch.cuda.get_device_properties(torch.device("cuda")).multi_processor_count
    work = [(name, 1, "gemv", tiles) for name, (n, k) in SHAPES.items() for tiles in gemv_candidates(n, k, 4, sm_count)]
    work += [(name, rows, "tl.dot", tiles) for name, (n, k) in SHAPES.items() for rows in (16, 32, 64)
             for tiles in batch_candidates(n, k, 4, GROUP, rows, sm_count, torch.bfloat16)]
    # a [gate | up] weight's silu(gate) * up in natural_mma's epilogue, raced where a bucket keeps one without split-K
    work += [(name, rows, "silu_mul", SiluMulTiles(tiles, True)) for name, rows, _, tiles in work
             if isinstance(tiles, NaturalMmaTiles) and tiles.split_k == 1]
    work += [("qkv_proj", 128, "dequantize", tiles) for tiles in load_dequantize_candidates()]
    work += [(name, rows, "wide", tiles) for name, (n, k) in SHAPES.items() for rows in WIDE_BUCKETS
             for tiles in wide_candidates(n, k, 4, GROUP, rows, sm_count)]
    _precompile(work, jobs, zeros)


def _precompile(work: list, jobs: int, zeros: bool, timed: list = ()) -> None:
    """Compile every config once in ``jobs`` processes, so the timing pass finds them in Triton's cache: one launch
    per kernel, config and way Triton specializes the row count (1, a multiple of 16, other; the ``tl.dot`` kernels
    compile once for every row count); the four shapes' sizes and strides specialize alike (multiples of 16).
    ``work`` compiles as the loader and the model launch it (with the next weight's L2 prefetch), ``timed`` as the
    sweep times it (without: another compile of the same config, else made one by one in the timing pass)."""
    distinct = {(kernel, tiles, 1 if rows == 1 else 16 if rows % 16 == 0 else 0, prefetch):
                (name, rows, kernel, tiles, prefetch)
                for prefetch, listed in ((True, work), (False, timed)) for name, rows, kernel, tiles in listed}
    launches = list(distinct.values())
    chunks = [launches[i::jobs] for i in range(jobs)]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        failed = sum(pool.starmap(_compile_chunk, [(chunk, zeros) for chunk in chunks]))
    print(f"compiled {len(launches)} kernels in {jobs} processes ({failed} failed; reported when timed)")


def _compile_chunk(chunk: list, zeros: bool) -> int:
    from treadle.kernels.int_kernel_plan import run_tiles
    from treadle.layers.small_batch import l2_prefetch_bytes, l2_prefetch_limit

    device = torch.device("cuda")
    tensors: dict[str, tuple] = {}
    failed = 0
    for name, rows, kernel, tiles, prefetch in chunk:
        n, k = SHAPES[name]
        if name not in tensors:
            tensors[name] = (torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=device),
                             torch.ones(n, k // GROUP, dtype=torch.bfloat16, device=device),
                             torch.zeros(n, k // GROUP, dtype=torch.bfloat16, device=device) if zeros else None)
        words, scales, zero_points = tensors[name]
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        try:
            # With the L2 prefetch of a next weight's head, as the loader times them and the model runs them; or
            # without, as the sweep times them (bench/int_weights.py's PackedWeight.run).
            head = l2_prefetch_bytes(words, l2_prefetch_limit()) if prefetch else None
            run_tiles(x, words, scales, zero_points, 4, GROUP, tiles, head)
            torch.cuda.synchronize()
        except Exception:
            failed += 1
    return failed
