"""Where a benchmark writes its JSON when no ``--output`` is given: outside the source tree.

``$TREADLE_RESULTS_DIR`` when set (``TREADLE_RESULTS_DIR=bench/results`` to add a run to the
committed ones), else ``<cache root>/bench-results`` — ``~/.cache/treadle/bench-results``, or
under ``$TREADLE_CACHE_DIR``. The results committed under ``bench/results/`` are added there
on purpose (``--output bench/results/NAME.json``), never by running a benchmark.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from treadle.core.loading.default_model import models_cache_dir

RESULTS_DIR_ENV = "TREADLE_RESULTS_DIR"
COMMITTED_RESULTS = Path(__file__).resolve().parent / "results"


def results_dir() -> Path:
    """The folder for a benchmark's default output file (not created here)."""
    chosen = os.environ.get(RESULTS_DIR_ENV)
    if chosen:
        return Path(chosen).expanduser()
    return models_cache_dir().parent / "bench-results"


def default_output(name: str) -> Path:
    """``results_dir() / name``."""
    return results_dir() / name


def write_result(result: dict[str, Any], output: str | None, default_name: str) -> Path:
    """``result`` as indented JSON to ``output`` (else :func:`default_output` of ``default_name``), its folder made;
    prints and returns the path."""
    out = Path(output) if output else default_output(default_name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return out
