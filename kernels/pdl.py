"""Programmatic dependent launch (PDL) for the decode path's Triton kernels (imported only where Triton runs).

A one-token decode step replays ~160 of treadle's kernels back to back from a CUDA graph: weight GEMVs and the
attention between them. Stream-ordered, each one starts after the one before has finished and flushed its memory,
so HBM idles through every hand-over (the launch, the first loads' latency, the last programs' tail). On Hopper
and newer GPUs a kernel launched with PDL may be scheduled as soon as every program of the kernel before it has
called :func:`allow_next` (or exited); its programs then do what does not depend on that kernel — a one-token
GEMV loads its first weight block, the decode attention its first block of cached keys — and call
:func:`wait_for_previous` before anything else. The wait returns once the kernel before has completed and its
writes are visible.

The contract for a kernel launched with ``launch_pdl=True``:

- before :func:`wait_for_previous` it reads only what no kernel still running can write (weights; what earlier
  steps wrote, like the cached keys; buffers the host filled before the step), and writes nothing;
- it calls :func:`allow_next` (if at all) only after :func:`wait_for_previous`, so that the kernel after it starts
  only once everything before this one has completed: that is what makes the first rule hold for the next kernel.

Launched with PDL: the small-batch GEMVs and 16-bit tiles (a tile asks L2 for its first weight blocks before it
waits), the W4A16 GEMV (its first words loaded first) and ``natural_mma`` (kernels/packed_int_natural.py: the
tiles' L2 request), the add + RMSNorm kernel (it loads its weight first), the Triton decode attention and the LoRA
gather kernels (kernels/lora.py: each loads its adapter's weight block, through the token's slot, before it waits)
and the tensor-parallel peer all-reduce (kernels/peer_all_reduce.py). The matmuls give the go-ahead after their weight loop,
the all-reduce right after its wait (the next matmul then loads its first weights while the flags cross NVLink:
tp=2 bs=1 2.894 -> 2.771 ms on 2 x H200), the others not at all (they end on their own): on the H100, earlier go-aheads
(as soon as a GEMV or the attention has waited, or after a GEMV's first block or the attention's chunk) were
slower, the next kernel's early programs taking SM slots and bandwidth from the one still running, and so were
FP8's tiles with PDL (docs/lab/benchmarks-history.md). Kernels that do not use PDL (cuBLAS, PyTorch's) are ordered as usual.
``TREADLE_PDL=0`` turns it off for A/B runs; it is off before Hopper and under the Triton interpreter.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def enabled(device: torch.device) -> bool:
    """Whether treadle's one-token decode kernels on ``device`` launch with PDL: a CUDA GPU of compute capability
    9.0 or newer, not interpreted, not turned off by ``TREADLE_PDL=0``."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("TREADLE_PDL") == "0":
        return False
    return _hopper_or_newer(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _hopper_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Block until the kernel before has completed and its writes are visible (a no-op without PDL)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def allow_next(PDL: tl.constexpr):
    """Let the kernel after this one be scheduled once every program of this one has called this (or exited)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
