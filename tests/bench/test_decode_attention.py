"""`python -m treadle.bench.decode_attention` on the CPU (Triton's interpreter, in a subprocess: see
tests/plugins/test_triton_backend.py for why)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from treadle.bench.decode_attention import TUNABLES, parse_variant


def test_parse_variant_changes_only_what_it_names() -> None:
    assert parse_variant("") == TUNABLES
    assert parse_variant("min_split_tokens=16;decode_block_n=32") == {**TUNABLES, "min_split_tokens": 16,
                                                                      "decode_block_n": 32}
    with pytest.raises(SystemExit, match="block_m=16"):
        parse_variant("block_m=16")
    with pytest.raises(SystemExit, match="decode_block_n=big"):
        parse_variant("decode_block_n=big")


def test_every_case_and_variant_is_timed_and_the_variants_agree(tmp_path: Path) -> None:
    output = tmp_path / "decode.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "treadle.bench.decode_attention", "--device", "cpu", "--batch-sizes", "3",
               "--context", "7,70", "--layers", "2", "--heads", "4,2,16",
               "--variants", ",min_split_tokens=16;decode_block_n=16", "--output", str(output)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(output.read_text())["results"]
    assert [(r["bs"], r["context"], r["variant"]) for r in rows] == [  # bs 3: the interpreter is slow
        (3, context, variant) for context in (7, 70)
        for variant in ("defaults", "min_split_tokens=16;decode_block_n=16")]
    assert rows[1]["settings"] == {**TUNABLES, "min_split_tokens": 16, "decode_block_n": 16}
    assert all(r["us_per_layer"] > 0 and r["max_abs_diff_vs_first"] < 1e-4 for r in rows)
    # 70 keys in 16-key chunks split the work; the outputs still match the one-chunk defaults.
    assert "max |diff|" in run.stdout
