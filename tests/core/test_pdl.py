"""Programmatic dependent launch: when it is on, and that every kernel launched with it waits for the kernel
before it (core/pdl.py's contract; a kernel that skipped the wait could read its inputs before they are written).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from treadle.core import pdl  # noqa: E402

PACKAGE = Path(pdl.__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _reset_forced():
    yield
    pdl.set_enabled(None)


@pytest.fixture()
def hopper(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TREADLE_PDL", raising=False)
    monkeypatch.setattr(pdl, "_supports_pdl", lambda index: True)
    return torch.device("cuda", 0)


def test_on_for_a_hopper_gpu_unless_turned_off(hopper, monkeypatch):
    assert pdl.enabled(hopper)
    monkeypatch.setenv("TREADLE_PDL", "0")
    assert not pdl.enabled(hopper)
    pdl.set_enabled(True)
    assert pdl.enabled(hopper)
    pdl.set_enabled(False)
    monkeypatch.delenv("TREADLE_PDL")
    assert not pdl.enabled(hopper)


def test_off_before_hopper_on_the_cpu_and_under_the_interpreter(hopper, monkeypatch):
    assert not pdl.enabled(torch.device("cpu"))
    monkeypatch.setattr(pdl, "_supports_pdl", lambda index: False)
    assert not pdl.enabled(hopper)
    monkeypatch.setattr(pdl, "_supports_pdl", lambda index: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(hopper)


def _sources() -> list[tuple[Path, ast.Module]]:
    paths = [path for path in sorted(PACKAGE.rglob("*.py"))
             if not any(part.startswith(".") or part == "build" for part in path.relative_to(PACKAGE).parts)]
    return [(path, ast.parse(path.read_text())) for path in paths]


def test_every_pdl_kernel_waits_first_and_every_pdl_launch_tells_its_kernel():
    kernels, launches = 0, 0
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and "PDL" in [arg.arg for arg in node.args.args]:
                body = [stmt for stmt in node.body if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))]
                first = ast.unparse(body[0])
                if node.name != "wait_then_allow_next":
                    kernels += 1
                    assert first == "wait_then_allow_next(PDL)", f"{path.name}:{node.name} starts with {first!r}"
            if isinstance(node, ast.Call):
                keywords = {kw.arg: ast.unparse(kw.value) for kw in node.keywords}
                if "launch_pdl" in keywords:
                    launches += 1
                    assert keywords.get("PDL") == keywords["launch_pdl"], f"{path.name}: {ast.unparse(node)[:120]}"
    # small-batch matmul, add+RMSNorm, rotary, SiLU·mul, the KV write, Triton decode attention's two stages.
    assert kernels >= 7 and launches >= 7
