"""`treadle bench one-batch` runs end to end on the CPU (a tiny model of the 8B's kind) and writes its JSON."""

from __future__ import annotations

import json

from treadle.bench.one_batch import main


def test_one_batch_smoke_writes_results(tmp_path):
    output = tmp_path / "one_batch.json"
    assert main(["--tiny", "--device", "cpu", "--batch-sizes", "1,2", "--decode-steps", "3", "--input-len", "8",
                 "--backends", "torch_native", "--no-hf", "--no-profile", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    rows = result["results"]
    assert {row["batch_size"] for row in rows} == {1, 2}
    assert all(row["decode_step_ms"] > 0 and row["decode_tokens_per_s"] > 0 for row in rows)
    assert result["command"].startswith("treadle bench one-batch")
