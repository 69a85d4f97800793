"""Running a test file's ahead-of-time Triton compile checks in a subprocess without the interpreter (shared by the
compile-for-GPU tests; imported by name, see conftest.py). The file, run as a script, prints ``marker`` followed by
a JSON map of check name -> traceback (None when it compiled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def compile_in_subprocess(script: str, marker: str) -> dict[str, str | None]:
    """Run ``script`` with ``TRITON_INTERPRET`` unset and return its results (skips without Triton's AOT API)."""
    pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:  # pragma: no cover - a Triton without the ahead-of-time API
        pytest.skip("this Triton has no ahead-of-time compile API")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(marker)]
    assert proc.returncode == 0 and lines, f"compile subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len(marker):])
