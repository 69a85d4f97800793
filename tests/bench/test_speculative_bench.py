"""bench/speculative.py end to end on the CPU: the machinery part on a tiny model (oracle drafts: every draft kept)
and the ngram part (SmolLM2 by default; here the tiny model with a tokenizer): greedy outputs identical with and
without."""

from __future__ import annotations

import json

from treadle.bench.speculative import main


def test_machinery_part_keeps_every_oracle_draft(tmp_path, tiny_llama_dir, capsys):
    out = tmp_path / "spec.json"
    assert main(["--part", "machinery", "--model-dir", tiny_llama_dir, "--batch-sizes", "1,2", "--prompt-len", "8",
                 "--new-tokens", "11", "--repeats", "1", "--num-tokens", "4", "--set", "model.dtype=float32",
                 "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["machinery"]["rows"]
    assert [r["batch_size"] for r in rows] == [1, 2]
    assert [r["acceptance_length"] for r in rows] == [5.0, 5.0], rows
    # Timings of a tiny model on a shared CPU are noise (a 1-token call may take longer than an 11-token one).
    assert all({"decode_step_ms", "verify_step_ms", "plain_tok_s", "spec_tok_s", "speedup"} <= set(r) for r in rows)
    assert "verify/decode" in capsys.readouterr().out


def test_ngram_part_reports_both_runs_with_identical_outputs(tmp_path, tiny_llama_text_dir, capsys):
    out = tmp_path / "spec.json"
    assert main(["--part", "ngram", "--prompts", "2", "--many", "6", "--ngram-new-tokens", "16",
                 "--set", f"model.path={tiny_llama_text_dir}", "--output", str(out)]) == 0
    result = json.loads(out.read_text())["ngram"]
    assert result["identical_outputs"] is True
    assert result["ngram"]["bs1_acceptance_length"] > 1.0 and result["bs6_speedup"] > 0
    assert "greedy outputs identical: True" in capsys.readouterr().out
