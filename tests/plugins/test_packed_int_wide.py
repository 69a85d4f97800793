"""kernels/packed_int_wide.py's W4A16 kernel for 65 to 1024 tokens under TRITON_INTERPRET=1 on small shapes: its
plain-op twin (the PTX widening runs on GPUs only: tests/gpu/test_packed_int_wide_gpu.py) against
``x @ ((u - zero) * scale).T`` on the panel layout, and the plans the loader makes with it (its row buckets above
64, raced against the dequantization; fp16 activations: the interpreter's bf16 ``tl.dot`` is wrong)."""

from __future__ import annotations

import pytest

CHECKS = r"""
import dataclasses, json, torch
from treadle.kernels.int_kernel_plan import plan_kernels
from treadle.kernels.packed_int_dequant import DequantTiles
from treadle.kernels.packed_int_wide import WideMmaTiles, wide_candidates, wide_mma
from treadle.layers.packed_int import pack_panels
torch.manual_seed(0)


def weight(n, k, group, asym, dtype):
    values = torch.randint(0, 16, (n, k))
    scales = (torch.rand(n, k // group) * 0.01 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (n, k // group)).to(dtype) if asym else None
    groups = torch.arange(k) // group
    dense = (values.float() - (zeros.float()[:, groups] if asym else 8)) * scales.float()[:, groups]
    return pack_panels(values, 4), scales, zeros, dense


def error(run, n, k, rows, group, asym):
    words, scales, zeros, dense = weight(n, k, group, asym, torch.float16)
    x = torch.randn(rows, k).half()
    expected = x.float() @ dense.t()
    y = run(x, words, scales, zeros, group)
    assert y.dtype == torch.float16 and y.shape == (rows, n)
    return ((y.float() - expected).norm() / expected.norm()).item()


wide = {}
for name, (tiles, n, rows, group, asym) in {
        "two token tiles, two row tiles (the second part empty), split-K, zeros": (
            WideMmaTiles(128, 128, 2, asm=False), 160, 130, 128, True),
        "256 weight rows, 70 tokens, groups of 256": (WideMmaTiles(128, 256, num_warps=8, asm=False), 256, 70, 256,
                                                     False),
        "the tokens as M, two token tiles, split-K, zeros": (
            WideMmaTiles(128, 128, 2, 8, 2, asm=False, tokens_m=True), 160, 130, 128, True),
}.items():
    wide[name] = error(lambda x, w, s, z, g, tiles=tiles: wide_mma(x, w, s, z, 4, g, tiles), n, 512, rows, group,
                       asym)


# The loader's race (a pick that keeps wide_mma up to 256 rows, the dequantization from 512).
def pick(candidates, rows):
    if rows > 64 and isinstance(candidates[-1], DequantTiles) and rows < 512:
        return candidates[0]
    return candidates[-1] if rows > 256 else candidates[0]


plan = plan_kernels(160, 512, 4, 128, sm_count=4, pick=pick, dtype=torch.float16)
buckets = [[most, type(tiles).__name__] for most, tiles in plan.wide]
untimed = [len(plan_kernels(160, 512, 4, 128, 4, dtype=torch.float16).wide),
           len(plan_kernels(160, 512, 4, 128, 4, pick, dtype=torch.float32).wide)]
plan = dataclasses.replace(plan, wide=tuple((most, dataclasses.replace(t, asm=False)) for most, t in plan.wide))
planned = {rows: error(lambda x, w, s, z, g: plan.run(x, w, s, z, None), 160, 512, rows, 128, True)
           for rows in (100, 300)}
counts = {f"{rows}x{n}": [(t.block_n, t.split_k, t.tokens_m) for t in wide_candidates(n, 4096, 4, 128, rows, 132)]
          for rows, n in ((128, 4096), (1024, 4096), (128, 28672))}
print("RESULTS " + json.dumps({"wide": wide, "buckets": buckets, "dot_max_rows": plan.dot_max_rows,
                               "untimed": untimed, "planned": planned, "counts": counts}))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    from interpreted import interpreted_code_results

    return interpreted_code_results(CHECKS)


def test_wide_twin_gives_the_dequantized_matmul(results):
    assert len(results["wide"]) == 3
    for name, error in results["wide"].items():
        assert error < 2e-3, (name, error)


def test_loader_keeps_wide_buckets_up_to_the_first_the_dequantization_wins(results):
    assert results["buckets"] == [[128, "WideMmaTiles"], [256, "WideMmaTiles"]]
    assert results["dot_max_rows"] == 64
    assert results["untimed"] == [0, 0]  # untimed, or float32 activations: the kernels of before
    # 100 rows run the 128 bucket's wide_mma, 300 the dequantization and the matmul
    for rows, error in results["planned"].items():
        assert error < 2e-3, (rows, error)


def test_split_k_only_where_the_tiles_leave_the_sms_short(results):
    # o_proj at 128 rows: 32 row tiles of 128 (16 of 256) split 8 ways (the first launch also 4); at 1024 rows
    # (256 tiles) none; gate_up (224 row tiles) none.
    assert results["counts"] == {"128x4096": [[128, 8, False], [256, 8, False], [128, 8, True], [128, 4, False]],
                                 "1024x4096": [[128, 1, False], [256, 1, False], [128, 1, True]],
                                 "128x28672": [[128, 1, False], [256, 1, False], [128, 1, True]]}
