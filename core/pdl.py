"""Programmatic dependent launch (PDL) for treadle's Triton kernels (imported only where Triton kernels run).

On Hopper and newer GPUs a kernel launched with PDL may be scheduled while the kernel before it in the stream is
still running, instead of after it has finished and flushed its memory. A decode step replays hundreds of small
kernels from a CUDA graph, and each stream-ordered hand-over leaves the GPU idle for about a microsecond; with
PDL the next kernel's programs are already resident when the previous one ends.

The contract, which :func:`wait_then_allow_next` implements for a kernel: every program first waits
(``gdc_wait``) until the previous kernel has completed and its writes are visible — before its first load or
store, so it neither reads stale inputs nor overwrites what the previous kernel still reads — and then allows
the next kernel to be scheduled (``gdc_launch_dependents``). A kernel launched with PDL that skipped the wait could
finish before its predecessor, so the launch flag and the kernel's ``PDL`` constant always come from one
:func:`enabled` call. Kernels that do not use PDL (cuBLAS, PyTorch's) are ordered as usual.

``TREADLE_PDL=0`` (or :func:`set_enabled`) turns it off for A/B runs; it is off on GPUs before Hopper and under
the Triton interpreter.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

_forced: bool | None = None
EARLY_TRIGGER = tl.constexpr(os.environ.get("TREADLE_PDL_EARLY", "1") == "1")


def set_enabled(value: bool | None) -> None:
    """Force PDL on (where the GPU supports it) or off for kernels launched from now on; None lets
    ``TREADLE_PDL`` decide again."""
    global _forced
    _forced = value


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: a CUDA GPU of compute capability 9.0 or newer, unless
    turned off."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    wanted = _forced if _forced is not None else os.environ.get("TREADLE_PDL", "1") != "0"
    return wanted and _supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@triton.jit
def wait_then_allow_next(PDL: tl.constexpr):
    """First statement of a kernel launched with ``launch_pdl=PDL`` (see the module docstring)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        if EARLY_TRIGGER:
            tl.extra.cuda.gdc_launch_dependents()
