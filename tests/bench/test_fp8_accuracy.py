"""``python -m treadle.bench.fp8_accuracy`` prints tables a person reads, and the JSON keeps every figure."""

from __future__ import annotations

import json
from pathlib import Path

from treadle.bench import fp8_accuracy

COMMITTED = Path(fp8_accuracy.__file__).parent / "results" / "fp8_accuracy_cpu_exact_top.json"


def test_tiny_logits_run_prints_a_table_not_json(tmp_path, capsys):
    out = tmp_path / "fp8.json"
    assert fp8_accuracy.main(["--device", "cpu", "--skip-smollm2", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| weights vs reference | max abs diff | RMS abs diff | same argmax |" in printed
    assert "| fp8 vs bf16 |" in printed and "{" not in printed
    assert json.loads(out.read_text())["tiny_logits"]["fp8_vs_bf16"]["argmax_agreement"] > 0


def test_greedy_table_has_a_row_per_comparison_of_a_committed_run():
    greedy = json.loads(COMMITTED.read_text())["smollm2_greedy"]
    table = fp8_accuracy.format_greedy_table(greedy).splitlines()
    assert len(table) == 3 + sum("_vs_" in key for key in greedy)
    assert "| fp8 vs fp8, 16-bit head | 20 / 20 | 100.0% |" in table
