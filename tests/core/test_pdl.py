"""kernels/pdl.py decides where kernels launch with programmatic dependent launch: only on a Hopper-or-newer CUDA
GPU, never on the CPU, under the Triton interpreter or with ``TREADLE_PDL=0``."""

from __future__ import annotations

import torch

from treadle.kernels import pdl


def test_pdl_is_off_on_the_cpu():
    assert not pdl.enabled(torch.device("cpu"))


def test_the_interpreter_and_the_switch_turn_pdl_off(monkeypatch):
    monkeypatch.setattr(pdl, "_hopper_or_newer", lambda index: True)
    cuda = torch.device("cuda", 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TREADLE_PDL", raising=False)
    assert pdl.enabled(cuda)
    monkeypatch.setenv("TREADLE_PDL", "0")
    assert not pdl.enabled(cuda)
    monkeypatch.setenv("TREADLE_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(cuda)


def test_gpus_before_hopper_launch_without_pdl(monkeypatch):
    monkeypatch.setattr(pdl, "_hopper_or_newer", lambda index: index == 1)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TREADLE_PDL", raising=False)
    assert not pdl.enabled(torch.device("cuda", 0)) and pdl.enabled(torch.device("cuda", 1))
