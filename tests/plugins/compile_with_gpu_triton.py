"""Compile every kernel of ``test_triton_compiles_for_gpu.py`` for sm_90 with another Triton release: the one the
GPU machine runs (``make compile-gpu-triton``: its own venv holds just that Triton; torch, treadle and the rest come
from .venv, whose site-packages is the one argument). Releases reject different code: a kernel that .venv's newer
Triton compiles can fail the GPU's older one, and that costs a device call to find out.
"""

from __future__ import annotations

import os
import site
import sys

site.addsitedir(sys.argv[1])  # after this venv's own site-packages: its Triton comes first

import triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_triton_compiles_for_gpu as checks  # noqa: E402

results = checks._compile_all()
failed = {name: error for name, error in results.items() if error is not None}
for name, error in failed.items():
    print(f"FAILED {name}:\n{error.strip().splitlines()[-1]}\n")
print(f"Triton {triton.__version__}: {len(results) - len(failed)} of {len(results)} kernels compile for sm_90")
sys.exit(1 if failed else 0)
