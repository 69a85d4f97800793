"""bench/grammar_masks.py: per-backend mask timings for a batch of matchers, as a table and JSON."""

from __future__ import annotations

import json

import pytest

from treadle.bench.grammar_masks import main

pytest.importorskip("xgrammar")
pytest.importorskip("llguidance")


def test_times_every_backend_thread_count_and_schema(tmp_path, capsys):
    from treadle.testing.tokenizer import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer(tmp_path / "tokenizer")
    output = tmp_path / "masks.json"
    assert main(["--tokenizer", tokenizer, "--rows", "4", "--steps", "12", "--threads", "auto,2",
                 "--output", str(output)]) == 0
    results = json.loads(output.read_text())["results"]
    assert [(r["schema"], r["backend"]) for r in results] == [
        (schema, backend) for schema in ("people.json", "people_no_max_length.json")
        for backend in ("xgrammar (threads auto)", "xgrammar (threads 2)", "llguidance")]
    assert all(r["single_us_per_row"] > 0 and r["batch_ms"] > 0 for r in results)
    assert "batch of 4" in capsys.readouterr().out
