"""Kernel checks run in a fresh Python under Triton's interpreter (imported by name, see conftest.py).

Triton decides interpret-or-compile when it is first imported, so a test module whose kernels must be
interpreted runs itself as a script with TRITON_INTERPRET=1 and prints its results as JSON after a marker;
:func:`interpreted_results` runs it and returns them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def interpreted_results(script: str, marker: str, timeout: int = 300) -> dict:
    """Run ``script`` with TRITON_INTERPRET=1 and return the JSON it printed after ``marker``."""
    return _results([script], marker, timeout)


def interpreted_code_results(code: str, marker: str = "RESULTS ", timeout: int = 600) -> dict:
    """Run the Python source ``code`` (``python -c``) with TRITON_INTERPRET=1 and return the JSON it printed after
    ``marker``."""
    return _results(["-c", code], marker, timeout)


def _results(args: list[str], marker: str, timeout: int) -> dict:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(marker)]
    assert proc.returncode == 0 and lines, f"kernel subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len(marker):])
