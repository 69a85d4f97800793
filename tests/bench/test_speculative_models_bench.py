"""bench/speculative_models.py runs end to end on a tiny model (the SmolLM2 default is a manual run): a draft equal
to the target keeps nearly every draft, and the outputs with and without speculation are identical."""

from __future__ import annotations

import json

from treadle.bench.speculative_models import main


def test_the_draft_model_bench_prints_and_writes_its_rows(tiny_llama_text_dir, tmp_path, capsys):
    output = tmp_path / "spec.json"
    result = main(["--target", tiny_llama_text_dir, "--draft", tiny_llama_text_dir, "--batch-sizes", "1,2",
                   "--max-new-tokens", "9", "--num-tokens", "3", "--output", str(output)])
    assert [row["batch_size"] for row in result["rows"]] == [1, 2]
    assert all(row["identical"] for row in result["rows"])
    assert all(row["acceptance_length"] > 2.5 for row in result["rows"])
    assert json.loads(output.read_text())["method"] == "draft"
    assert "accept len" in capsys.readouterr().out
