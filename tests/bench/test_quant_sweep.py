"""bench/quant_sweep.py's tables: each kernel's fastest config per shape and its 32-layer sum, and the trials of
the candidates that widen with fewer instructions named by kernel."""

from __future__ import annotations

from treadle.bench.int_weights import SHAPES
from treadle.bench.quant_sweep import _kernel, kernel_table, magic_trials, trials


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
    assert {_kernel(t) for t in magic_trials(n, k, 1, 132)} == {"gemv_subnormal", "magic_gemv"}
    assert {_kernel(t) for t in magic_trials(n, k, 32, 132)} == {"magic_mma"}
    # The lean GEMV's other tiles, and the tensor-core loop the loader does not time.
    assert {_kernel(t) for t in trials(n, k, 1, 132)} == {"gemv", "gemv_lean", "gemv_hmma"}
