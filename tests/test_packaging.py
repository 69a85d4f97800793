"""`pip install .` ships every package and registers every built-in plugin entry point."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_every_package_and_entry_point(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("treadle-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {Path(name).parent.as_posix() for name in names if name.endswith("__init__.py")}
    expected = {
        ("treadle/" + init.parent.relative_to(ROOT).as_posix()).rstrip("/.")
        for init in ROOT.rglob("__init__.py")
        if not {"tests", "examples", ".venv", "build"} & set(init.relative_to(ROOT).parts)
    }
    assert expected <= shipped, f"packages missing from pyproject's list: {sorted(expected - shipped)}"
    assert not [name for name in names if name.startswith("treadle/bench/results/")], \
        "benchmark results stay in the repository, out of the installed package"
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "treadle = treadle.cli:main" in entry_points
    for module in ("treadle.plugins.attention.torch_native", "treadle.plugins.schedulers.policies",
                   "treadle.plugins.kv_allocators.paged", "treadle.plugins.models.llama",
                   "treadle.plugins.grammar.xgrammar_backend", "treadle.plugins.grammar.llguidance_backend",
                   "treadle.plugins.speculators.ngram", "treadle.plugins.speculators.draft",
                   "treadle.plugins.speculators.eagle3", "treadle.plugins.lora_backends.triton"):
        assert module in entry_points
