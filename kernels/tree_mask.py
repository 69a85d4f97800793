"""Packed attention masks of a tree verify step, in the layout FlashInfer's prefill wrapper reads
(``plan(..., packed_custom_mask=)``).

Request ``b`` of a verify step has ``t`` new tokens (draft-tree nodes) at the end of its ``L_b`` keys. Its mask is
``t`` rows of ``L_b`` bits, row-major: row ``a`` sees every key of the prefix (the first ``L_b - t``) and, among the
step's tokens, those ``tree_mask[b, a]`` marks (the node's ancestors and itself). Under a sliding window of ``W``
keys a node at depth ``d`` (position ``L_b - t + d``) sees only keys less than ``W`` positions before its own.
Bits are packed little-endian (bit ``e % 8`` of byte ``e // 8``). Request ``b``'s bytes start at byte ``t * (L_0 + ... + L_{b-1})``: FlashInfer 0.6's
``plan`` derives a packed mask's per-request offsets as those element counts and the kernel adds them to the
byte pointer, so segments sit that far apart (an eighth of the space is used; a verify step's mask is small).

:func:`pack_tree_mask` writes it on the device with one Triton kernel, reading the lengths on the device, so a CUDA
graph can replay it and nothing waits for the host; :func:`pack_tree_mask_reference` is the same in torch.
"""

from __future__ import annotations

import functools

import torch


def tree_mask_bytes(tokens_per_req: int, seq_lens_cpu: torch.Tensor) -> int:
    """The bytes a step's packed mask spans (its last request's segment, rounded up, past the others')."""
    lens = seq_lens_cpu.to(torch.int64)
    if lens.numel() == 0:
        return 1
    return int(tokens_per_req * lens[:-1].sum()) + (tokens_per_req * int(lens[-1]) + 7) // 8


def pack_tree_mask(tree_mask: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                   window: int | None = None) -> torch.Tensor:
    """Write the packed mask of ``tree_mask`` ``[bs, t, t]`` (bool or uint8) over keys ``seq_lens`` ``[bs]`` (on the
    device; ``window``: a sliding window's keys, None for none) into ``out`` (uint8, at least
    :func:`tree_mask_bytes` long); returns ``out``."""
    bs, t, _ = tree_mask.shape
    if bs == 0:
        return out
    mask = tree_mask if tree_mask.dtype == torch.uint8 else tree_mask.to(torch.uint8)
    depth = mask.sum(dim=2, dtype=torch.int32) - 1
    _kernel()[(bs,)](mask.contiguous(), depth, seq_lens, out, window or 0, T=t,
                     BS_BLOCK=max(2, 1 << (bs - 1).bit_length()), WINDOWED=bool(window), BLOCK=128)
    return out


def pack_tree_mask_reference(tree_mask: torch.Tensor, seq_lens_cpu: torch.Tensor,
                             window: int | None = None) -> torch.Tensor:
    """:func:`pack_tree_mask` in torch, one request at a time (tests, and a reading of the layout)."""
    bs, t, _ = tree_mask.shape
    out = torch.zeros(tree_mask_bytes(t, seq_lens_cpu), dtype=torch.uint8)
    start = 0
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.int32)
    for b in range(bs):
        length = int(seq_lens_cpu[b])
        nodes = tree_mask[b].cpu().bool()
        rows = torch.ones(t, length, dtype=torch.bool)
        rows[:, length - t:] = nodes
        if window:
            key_positions = torch.arange(length)
            depth = nodes.sum(dim=1) - 1
            key_positions[length - t:] = length - t + depth
            rows &= key_positions[None, :] > (length - t + depth)[:, None] - window
        bits = torch.nn.functional.pad(rows.flatten(), (0, -(t * length) % 8)).view(-1, 8).to(torch.int32)
        packed = (bits * weights).sum(dim=1).to(torch.uint8)
        out[start:start + packed.numel()] = packed
        start += t * length
    return out


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def pack_tree_mask_kernel(tree_mask, depth, seq_lens, out, window, T: tl.constexpr, BS_BLOCK: tl.constexpr,
                              WINDOWED: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        earlier = tl.arange(0, BS_BLOCK)
        before = tl.load(seq_lens + earlier, mask=earlier < b, other=0).to(tl.int64)
        start = T * tl.sum(before, axis=0)
        length = tl.load(seq_lens + b).to(tl.int64)
        prefix = length - T
        bits_total = T * length
        num_bytes = (bits_total + 7) // 8
        bit = tl.arange(0, 8)
        for first in range(0, num_bytes, BLOCK):
            byte = first + tl.arange(0, BLOCK)
            element = byte[:, None] * 8 + bit[None, :]
            valid = element < bits_total
            row = element // length
            column = element % length
            in_prefix = column < prefix
            node = tl.load(tree_mask + b * T * T + row * T + (column - prefix),
                           mask=valid & (column >= prefix), other=0)
            on = valid & (in_prefix | (node != 0))
            if WINDOWED:  # keys less than the window before the row node's position (its depth past the prefix)
                row_position = prefix + tl.load(depth + b * T + row, mask=valid, other=0)
                key_depth = tl.load(depth + b * T + (column - prefix), mask=valid & (column >= prefix), other=0)
                key_position = tl.where(in_prefix, column, prefix + key_depth)
                on = on & (key_position > row_position - window)
            packed = tl.sum(on.to(tl.int32) << bit[None, :], axis=1)
            tl.store(out + start + byte, packed.to(tl.uint8), mask=byte < num_bytes)

    return pack_tree_mask_kernel
