"""bench/quant_sweep.py's tables: each kernel's fastest config per shape and its 32-layer sum, and the trials named
by kernel; a full sweep times each config once."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from treadle.bench.int_weights import SHAPES
from treadle.bench.quant_sweep import _kernel, kernel_table, magic_trials, table, trials, variants
from treadle.kernels.packed_int import gemv_candidates


def _result(shape: str, rows: int, kernel: str, us: float, correct: bool = True) -> dict:
    return {"shape": shape, "rows": rows, "kernel": kernel, "us": us, "bf16_us": 20.0, "tiles": "t",
            "speedup": 20.0 / us, "roofline_fraction": 0.5, "correct": correct}


def test_kernel_table_sums_each_kernels_fastest_correct_config_over_the_layers():
    results = [_result(shape, 1, "gemv", 10.0) for shape in SHAPES]
    results += [_result(shape, 1, "gemv_subnormal trial", us) for shape in SHAPES for us in (8.0, 9.0)]
    results += [_result(shape, 1, "magic_mma trial", 1.0, correct=False) for shape in SHAPES]
    lines = kernel_table(results, [1]).splitlines()
    subnormal = next(line for line in lines if line.startswith("gemv_subnormal"))
    # 4 shapes x 8 us x 32 layers = 1.02 ms against 4 x 20 us x 32: 2.50x; a wrong config is never ranked.
    assert subnormal.split()[-2:] == ["1.02", "2.50x"]
    assert not any(line.startswith("magic_mma") for line in lines)


def test_trials_name_their_kernels():
    n, k = SHAPES["down_proj"]
    assert magic_trials(n, k, 1, 132) == []  # magic_mma is no longer timed at one row
    assert {_kernel(t) for t in magic_trials(n, k, 32, 132)} == {"magic_mma"}
    assert {_kernel(t) for t in trials(n, k, 1, 132)} == {"gemv"}


def test_a_full_sweep_times_each_one_row_config_once_the_loaders_subnormal_ones_as_today(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    n, k = SHAPES["o_proj"]
    listed = variants(n, k, 1, torch.device("cuda"))
    tiles = [t for _, t in listed]
    assert len(tiles) == len(set(tiles))
    loader = [t for t in gemv_candidates(n, k, 4, 132) if t.subnormal]
    assert loader and set(loader) <= set(tiles)
    assert {kernel for kernel, t in listed if getattr(t, "subnormal", False)} == {"gemv_subnormal"}
    results = [_result(shape, 1, kernel, us) for shape in SHAPES
               for kernel, us in (("gemv", 10.0), ("gemv_subnormal", 8.0), ("int_mma", 5.0))]
    row = next(line for line in table(results, [1]).splitlines() if line.startswith("o_proj M=1"))
    assert row.split()[3:5] == ["8.0", "5.0"]  # today's fastest is the subnormal GEMV; int_mma a candidate


def test_the_natural_sweep_times_the_loaders_launches_and_natural_mmas_trials_alone(monkeypatch):
    from treadle.bench.quant_sweep import narrow_variants

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    n, k = SHAPES["gate_up_proj"]
    listed = narrow_variants(n, k, 32, torch.device("cuda"), only="natural")
    kinds = {kernel for kernel, _ in listed}
    assert {"magic_mma", "natural_mma", "natural_mma trial"} <= kinds  # the loader's launches, then the trials
    assert {kernel for kernel in kinds if kernel.endswith("trial")} == {"natural_mma trial"}
    assert len(listed) == len({t for _, t in listed})


def test_the_sweep_compiles_its_timed_launches_as_it_times_them_and_the_loaders_as_the_model_runs_them(monkeypatch):
    # Both ahead of the timing pass, in parallel: the timed launches without the next weight's L2 prefetch (as
    # PackedWeight.run times them), the loader's with it (as a model loaded after the sweep runs them).
    from treadle.bench import quant_sweep

    compiled = []

    class Pool:
        def __init__(self, jobs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def starmap(self, fn, arguments):
            for chunk, zeros in arguments:
                compiled.extend(chunk)
            return [0] * len(arguments)  # failures per chunk

    monkeypatch.setattr(quant_sweep.multiprocessing, "get_context", lambda kind: SimpleNamespace(Pool=Pool))
    loader = [("o_proj", 32, "magic_mma", "a"), ("o_proj", 16, "magic_mma", "b")]
    quant_sweep._precompile(loader, 2, False, timed=[("o_proj", 32, "magic_mma", "a")])
    assert sorted((tiles, prefetch) for _, _, _, tiles, prefetch in compiled) == [("a", False), ("a", True),
                                                                                  ("b", True)]


def test_the_gemv_sweep_times_the_loaders_one_row_launches_and_the_wide_programs(monkeypatch):
    from treadle.bench.quant_sweep import narrow_variants

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    n, k = SHAPES["o_proj"]
    listed = narrow_variants(n, k, 1, torch.device("cuda"), only="gemv")
    trial_tiles = [t for kernel, t in listed if kernel == "gemv_subnormal trial"]
    assert trial_tiles and all(t.block_w >= 256 and t.num_warps >= 2 for t in trial_tiles)
    assert {kernel for kernel, _ in listed} == {"gemv", "gemv_subnormal", "gemv_subnormal trial"}
    assert narrow_variants(n, k, 32, torch.device("cuda"), only="gemv")[-1][0] != "gemv_subnormal trial"
