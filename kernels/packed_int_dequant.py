"""The whole-weight dequantization of the panel-packed integer weights (``kernels/packed_int.py``'s layout: int32
``[N, K * bits / 32]``, each row in panels of 16 words whose value slot ``j`` of word ``c`` is the panel's element
``16 * j + c``): what batches above a shape's ``IntKernelPlan.dot_max_rows`` (and act-order weights with uneven
groups) run before the library matmul (``kernels/int_kernel_plan.py``).

It only moves bytes (half a byte a 4-bit value read, two written), so it is written to run at the memory's
bandwidth: each program walks ``panels`` panels of ``block_n`` rows, the next panel's words (16 bytes a load) and
scales loaded before this one's are widened; a panel's values are one ``[rows, slots, 16]`` tile whose stores are 16
contiguous bytes a thread; each group's scale (and zero) is loaded once per panel and row, not per value; and the
16-bit weight goes to one buffer per device (:class:`DequantBuffer`) instead of a new tensor each call.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from treadle.kernels.packed_int import PANEL_WORDS


@dataclass(frozen=True)
class DequantTiles:
    """One launch of :func:`dequantize`: ``block_n`` weight rows a program, ``panels`` panels (16 words each) it
    walks along K, ``num_warps``."""

    block_n: int = 32
    panels: int = 4
    num_warps: int = 4


def load_dequantize_candidates() -> list[DequantTiles]:
    """The launch configs the loader times (``kernels/int_kernel_plan.py``): the default, a larger program on
    8 warps and a smaller one."""
    return [DequantTiles(), DequantTiles(64, 8, 8), DequantTiles(16, 2)]


def dequantize_candidates() -> list[DequantTiles]:
    """The launch configs ``python -m treadle.bench.quant_kernels --large`` times (the default first)."""
    listed = [DequantTiles()] + [DequantTiles(block_n, panels) for block_n in (16, 32, 64) for panels in (2, 4, 8)]
    listed += [DequantTiles(32, 1), DequantTiles(32, 4, 8), DequantTiles(64, 4, 8), DequantTiles(64, 8, 8)]
    return list(dict.fromkeys(listed))


def dequantize(weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, g_idx: torch.Tensor | None,
               bits: int, group: int, dtype: torch.dtype, out: torch.Tensor | None = None,
               tiles: DequantTiles = DequantTiles()) -> torch.Tensor:
    """The weight ``[N, K]`` in ``dtype`` (into ``out`` when given: ``[N, K]``, unit stride along K), K in natural
    order; ``g_idx`` (int32, one group per column): act-order weights whose sorted groups are uneven."""
    n, k = weight.shape[0], weight.shape[1] * (32 // bits)
    out = torch.empty(n, k, dtype=dtype, device=weight.device) if out is None else out
    panels = weight.shape[1] // PANEL_WORDS
    per_program = min(tiles.panels, panels)
    _dequantize_kernel[(triton.cdiv(panels, per_program), triton.cdiv(n, tiles.block_n))](
        weight, scales, zeros if zeros is not None else scales, g_idx if g_idx is not None else scales, out, n,
        panels, per_program, weight.stride(0), scales.stride(0), out.stride(0), BITS=bits, GROUP=group,
        HAS_ZEROS=zeros is not None, HAS_GIDX=g_idx is not None, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps)
    return out


class DequantBuffer:
    """The buffer one device's large-batch dequantizations write, shared by the integer layers that hold it (one
    weight at a time: the kernels run in stream order, and the library matmul reads the weight before the next
    layer's dequantization overwrites it). Each layer reserves its size at load; the first large batch allocates
    the largest, after the KV pool was sized (the memory a new tensor per call took, no more). CUDA graphs capture
    its address, so a tensor outgrown (a weight past every reserved size) is kept while the buffer lives; it lives
    as long as a layer holds it (:func:`shared_dequant_buffer`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reserved = 0  # bytes
        self.tensor: torch.Tensor | None = None
        self.outgrown: list[torch.Tensor] = []

    def reserve(self, n: int, k: int, dtype: torch.dtype) -> None:
        """Size the buffer for an ``[n, k]`` weight in ``dtype``."""
        self.reserved = max(self.reserved, n * k * dtype.itemsize)

    def view(self, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
        """The buffer's head as an ``[n, k]`` ``dtype`` tensor."""
        need = n * k * dtype.itemsize
        if self.tensor is None or self.tensor.numel() < need:
            if self.tensor is not None:
                self.outgrown.append(self.tensor)
            self.tensor = torch.empty(max(need, self.reserved), dtype=torch.uint8, device=self.device)
        return self.tensor[:need].view(dtype).view(n, k)


def shared_dequant_buffer(device: torch.device) -> DequantBuffer:
    """``device``'s :class:`DequantBuffer`: the one the loaded layers hold, or a new one where none does (so a model
    shut down takes its buffer with it)."""
    buffer = _buffers.get(str(device))
    if buffer is None:
        buffer = _buffers[str(device)] = DequantBuffer(device)
    return buffer


# str(device) -> the buffer the live layers on it hold.
_buffers: weakref.WeakValueDictionary[str, DequantBuffer] = weakref.WeakValueDictionary()


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, panels, per_program, stride_wn, stride_sn, stride_on,
                       BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    # One program: BLOCK_N rows of `per_program` consecutive panels (program_id 0 walks K, so neighbouring programs
    # write neighbouring stretches of the same rows). A value becomes float32 2**23 + u with one and-or (its bits
    # under the exponent of 2**23), and 2**23 comes off exactly: (u - zero) * scale in float32, as the reference.
    PACK: tl.constexpr = 32 // BITS
    PANEL: tl.constexpr = 16 * PACK
    MASK: tl.constexpr = (1 << BITS) - 1
    MIDPOINT: tl.constexpr = 8388608.0 + (1 << (BITS - 1))
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_j = tl.arange(0, PACK)
    offs_c = tl.arange(0, 16)
    in_panel = (16 * offs_j[:, None] + offs_c[None, :])[None, :, :]  # [1, PACK, 16]: slot j of word c
    shifts = (BITS * offs_j)[None, :, None]
    first = tl.program_id(0) * per_program
    last = tl.minimum(first + per_program, panels)
    w_rows = w_ptr + offs_n[:, None] * stride_wn + offs_c[None, :]
    o_rows = out_ptr + offs_n[:, None, None] * stride_on + in_panel
    s_rows = offs_n * stride_sn  # each row's first group
    words = tl.load(w_rows + first * 16, mask=n_mask[:, None], other=0, eviction_policy="evict_first")
    s, zero = _panel_scales(s_ptr, z_ptr, g_ptr, s_rows, n_mask, first, offs_j, in_panel, GROUP, PACK, HAS_ZEROS,
                            HAS_GIDX)
    for panel in range(first, last):
        # The next panel's words and scales in flight while this one's are widened and stored (the last panel's
        # scales again on the last step: a valid address, in L1).
        ahead_mask = n_mask[:, None] & ((panel + 1) * 16 + offs_c < last * 16)[None, :]
        ahead = tl.load(w_rows + (panel + 1) * 16, mask=ahead_mask, other=0, eviction_policy="evict_first")
        s_ahead, zero_ahead = _panel_scales(s_ptr, z_ptr, g_ptr, s_rows, n_mask, tl.minimum(panel + 1, last - 1),
                                            offs_j, in_panel, GROUP, PACK, HAS_ZEROS, HAS_GIDX)
        u = (((words[:, None, :] >> shifts) & MASK) | 0x4B000000).to(tl.float32, bitcast=True)
        if HAS_ZEROS:
            w = ((u - 8388608.0) - zero) * s
        else:
            w = (u - MIDPOINT) * s
        tl.store(o_rows + panel * PANEL, w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None, None])
        words, s, zero = ahead, s_ahead, zero_ahead


@triton.jit
def _panel_scales(s_ptr, z_ptr, g_ptr, s_rows, n_mask, panel, offs_j, in_panel, GROUP: tl.constexpr,
                  PACK: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_GIDX: tl.constexpr):
    """float32 ``(scale, zero)`` of the rows (``s_rows``: their first group's offset) for panel ``panel``,
    broadcastable to its ``[rows, PACK, 16]`` values: a group per column (``HAS_GIDX``), per panel or per
    ``GROUP // 16`` value slots; the zero is the scale, unread, without zero points."""
    PANEL: tl.constexpr = 16 * PACK
    if HAS_GIDX:
        index = s_rows[:, None, None] + tl.load(g_ptr + panel * PANEL + in_panel)
    elif GROUP >= PANEL:
        index = (s_rows + panel * PANEL // GROUP)[:, None, None]
    else:
        index = (s_rows[:, None] + (panel * PANEL + 16 * offs_j)[None, :] // GROUP)[:, :, None]
    s = tl.load(s_ptr + index, mask=n_mask[:, None, None], other=0).to(tl.float32)
    zero = s
    if HAS_ZEROS:
        zero = tl.load(z_ptr + index, mask=n_mask[:, None, None], other=0).to(tl.float32)
    return s, zero
