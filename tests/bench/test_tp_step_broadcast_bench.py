"""``treadle bench tp-step-broadcast``'s engine table: each tp=2 median over the tp=1 run of the same call."""

from treadle.bench.tp_step_broadcast import engine_table


def _row(mode: str, ms: float, round_index: int = 0) -> dict:
    return {"step_broadcast": mode, "round": round_index, "decode_step_ms": ms, "first_tokens": [1, 2, 3]}


def test_each_tp2_median_is_divided_by_the_tp1_run():
    rows = [_row("tp1", 4.0), _row("auto", 2.6), _row("auto", 2.8, 1), _row("gloo", 3.0)]
    lines = engine_table(rows).splitlines()
    assert "| auto | 2.600, 2.800 | 2.700 | 0.675x |" in lines
    assert "| gloo | 3.000 | 3.000 | 0.750x |" in lines
    assert "| tp1 | 4.000 | 4.000 | 1.000x |" in lines
    assert lines[-1] == "first tokens identical in every run: True"


def test_without_a_tp1_run_the_ratio_column_is_empty():
    lines = engine_table([_row("auto", 2.6), {**_row("gloo", 2.7), "first_tokens": [9]}]).splitlines()
    assert "| auto | 2.600 | 2.600 | - |" in lines
    assert lines[-1] == "first tokens identical in every run: False"
