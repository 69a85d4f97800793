"""Prefetching the next weight into L2 while a decode graph's small kernels run.

A decode step of a few requests is a chain of weight GEMVs that stream their weights from HBM, separated by
kernels that read almost nothing (norms, rotary, the KV write, attention over a short context). While those
run, and in the launch gaps around them, HBM sits idle. :class:`WeightPrefetch` fills that time: when a
captured decode forward enqueues a linear layer, it also enqueues, on a side stream, an L2 prefetch of the
first ``budget`` bytes of the next linear layer's weight. The side stream forks from the capture stream after
the current layer and joins it at the end of the forward, so the graph orders the prefetch after the current
GEMV and before nothing: the next GEMV never waits for it, it finds part of its weight already in L2.

The order of the linear layers is recorded from one uncaptured forward (every module with a 2-D ``weight`` and
a ``quant_method`` attribute, the contract of the model plugins' linear layers), so any model family gets it
without naming its layers.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import triton
import triton.language as tl
from torch import nn

_LINE_BYTES = 128
_LINES_PER_PROGRAM = 1024


def budget_bytes() -> int:
    """Bytes of each next weight to prefetch (``TREADLE_L2_PREFETCH_MB``, default 0: off)."""
    return int(float(os.environ.get("TREADLE_L2_PREFETCH_MB", "0")) * (1 << 20))


@triton.jit
def _l2_prefetch_evict_last(base, n_lines, sink, LINES: tl.constexpr):
    line = tl.minimum(tl.program_id(0) * LINES + tl.arange(0, LINES), n_lines - 1)
    done = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n mov.u32 $0, 0;", "=r,l",
                                     [base + line.to(tl.int64) * 128], dtype=tl.int32, is_pure=False, pack=1)
    total = tl.sum(done)
    # Never true: the store only keeps the prefetches from being removed as unused.
    tl.store(sink + tl.program_id(0), total, mask=total == 0x7FFFFFF1)


@triton.jit
def _l2_prefetch_evict_normal(base, n_lines, sink, LINES: tl.constexpr):
    line = tl.minimum(tl.program_id(0) * LINES + tl.arange(0, LINES), n_lines - 1)
    done = tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l",
                                     [base + line.to(tl.int64) * 128], dtype=tl.int32, is_pure=False, pack=1)
    total = tl.sum(done)
    tl.store(sink + tl.program_id(0), total, mask=total == 0x7FFFFFF1)


class WeightPrefetch:
    """L2 prefetch of each linear layer's successor during captured decode forwards (see the module docstring)."""

    def __init__(self, model: nn.Module, device: torch.device, budget: int) -> None:
        self.budget = budget
        self.device = device
        self.linears = [m for m in model.modules()
                        if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
                        and hasattr(m, "quant_method")]
        self.order: list[nn.Module] = []
        self.next_weight: dict[int, torch.Tensor] = {}
        self.side = torch.cuda.Stream(device=device)
        self.sink = torch.zeros(4096, dtype=torch.int32, device=device)
        hint = os.environ.get("TREADLE_L2_PREFETCH_HINT", "last")
        self.kernel = _l2_prefetch_evict_last if hint == "last" else _l2_prefetch_evict_normal
        self._recording = False
        self._active = False
        self._hooks = [hook for module in self.linears
                       for hook in (module.register_forward_pre_hook(self._pre_hook),
                                    module.register_forward_hook(self._post_hook))]

    def close(self) -> None:
        """Remove the hooks (captured graphs keep their prefetches)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _pre_hook(self, module: nn.Module, args: tuple) -> None:
        if self._recording:
            self.order.append(module)

    def _post_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not self._active:
            return
        weight = self.next_weight.get(id(module))
        if weight is None:
            return
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):
            self._prefetch(weight)

    def _prefetch(self, weight: torch.Tensor) -> None:
        nbytes = min(self.budget, weight.numel() * weight.element_size())
        lines = max(1, nbytes // _LINE_BYTES)
        grid = (-(-lines // _LINES_PER_PROGRAM),)
        self.kernel[grid](weight.view(torch.uint8).view(-1), lines, self.sink, LINES=_LINES_PER_PROGRAM,
                          num_warps=8)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the order in which the linear layers run (one uncaptured forward)."""
        self.order.clear()
        self._recording = True
        try:
            yield
        finally:
            self._recording = False
            self.next_weight = {id(a): b.weight for a, b in zip(self.order, self.order[1:])
                                if b.weight.is_contiguous()}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Prefetch during the forward inside this block, joining the side stream at its end."""
        self._active = True
        try:
            yield
        finally:
            self._active = False
            torch.cuda.current_stream(self.device).wait_stream(self.side)
