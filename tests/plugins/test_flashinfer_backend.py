"""The `flashinfer` backend's registration and refusals, on the CPU (its kernels run in tests/gpu/)."""

from __future__ import annotations

import builtins
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from treadle.core.registry import build_registry
from treadle.plugins.attention.flashinfer import FlashInferAttnBackend


def test_registered_without_importing_flashinfer() -> None:
    code = (
        "import sys\n"
        "from treadle.core.registry import build_registry\n"
        "registry = build_registry()\n"
        "assert registry.get('attention', 'flashinfer').__name__ == 'FlashInferAttnBackend'\n"
        "assert 'flashinfer' not in sys.modules, 'registration imported flashinfer'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert build_registry().table()["attention"]["flashinfer"] == "treadle"


def test_missing_flashinfer_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_flashinfer(name, *args, **kwargs):
        if name == "flashinfer" or name.startswith("flashinfer."):
            raise ImportError("No module named 'flashinfer'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_flashinfer)
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    with pytest.raises(RuntimeError, match=r"treadle\[flashinfer\]"):
        FlashInferAttnBackend(SimpleNamespace(device=torch.device("cpu")))


def test_cpu_device_is_refused_with_the_alternative(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", SimpleNamespace())
    with pytest.raises(RuntimeError, match="CUDA device.*torch_native"):
        FlashInferAttnBackend(SimpleNamespace(device=torch.device("cpu")))
