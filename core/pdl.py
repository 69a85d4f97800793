"""Programmatic dependent launch (PDL): a weight GEMV that starts while the kernel before it still runs.

A one-token decode step replays hundreds of kernels from a CUDA graph. A GEMV that streams a weight from HBM
loses its first microsecond or so to the launch and to the latency of its first loads, and the small kernel
before it (a norm, SiLU·mul, the attention combine) leaves HBM idle meanwhile. On Hopper and newer GPUs a kernel
launched with PDL may be scheduled once every program of the kernel before it has called
:func:`allow_next_to_start`; it must call :func:`wait_for_previous` before it reads anything that kernel
writes (the wait returns when that kernel has finished and its memory is visible). In between, it may read
what no earlier kernel writes: the FP8 one-token GEMV (``plugins/models/small_batch_kernels.py``) prefetches
its first weight lines into L2 there.

Only that GEMV is launched with PDL; the small kernels that precede it allow it to start at their own start,
which is a no-op when the next kernel was launched normally. Measured on the H100 (docs/benchmarks.md):
launching every decode-path kernel with PDL made bf16 decode slower and FP8 no faster, so the rest stay
stream-ordered.

``TREADLE_PDL=0`` turns it off for A/B runs; it is off before Hopper and under the Triton interpreter.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` use PDL: a CUDA GPU of compute capability 9.0+, not interpreted, not
    turned off by ``TREADLE_PDL=0``."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("TREADLE_PDL") == "0":
        return False
    return _hopper_or_newer(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _hopper_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@triton.jit
def allow_next_to_start(PDL: tl.constexpr):
    """Let a kernel launched with PDL after this one be scheduled now (it still waits for this one's writes)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """In a kernel launched with ``launch_pdl=PDL``: block until the kernel before it has finished and its
    writes are visible. Nothing before this call may read what an earlier kernel writes, or write anything."""
    if PDL:
        tl.extra.cuda.gdc_wait()
