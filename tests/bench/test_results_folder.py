"""A benchmark run without --output writes its JSON outside the source tree (bench/results/ holds committed runs)."""

from __future__ import annotations

from pathlib import Path

from treadle.bench.one_batch import main
from treadle.bench.results_folder import COMMITTED_RESULTS

TINY_RUN = ["--tiny", "--device", "cpu", "--batch-sizes", "1", "--decode-steps", "2", "--input-len", "4",
            "--backends", "torch_native", "--no-hf", "--no-profile"]


def test_default_output_goes_to_the_cache_folder_not_the_tree(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TREADLE_RESULTS_DIR", raising=False)
    monkeypatch.setenv("TREADLE_CACHE_DIR", str(tmp_path / "cache"))
    committed = set(COMMITTED_RESULTS.iterdir())
    assert main(TINY_RUN) == 0
    written = list((tmp_path / "cache" / "bench-results").glob("one_batch_*.json"))
    assert len(written) == 1 and f"wrote {written[0]}" in capsys.readouterr().out
    assert set(COMMITTED_RESULTS.iterdir()) == committed


def test_results_dir_environment_chooses_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_RESULTS_DIR", str(tmp_path / "mine"))
    assert main(TINY_RUN) == 0
    assert [p.parent for p in Path(tmp_path / "mine").glob("one_batch_*.json")] == [tmp_path / "mine"]
