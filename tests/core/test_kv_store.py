"""The one-kernel KV write (kernels/kv_store.py) under the Triton interpreter against KVCache's torch path: the
same slots written, bit for bit, in 16/32-bit caches. (The interpreter's FP8 conversion does not round to
nearest, so the FP8 cache is checked on the GPU: tests/gpu/test_fp8_gpu.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from kv_store_checks import CHECKS  # noqa: E402


def test_store_kv_writes_what_the_torch_path_writes():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECKS, "cpu"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
