"""The packed tree masks the flashinfer backend plans tree verify steps with (kernels/tree_mask.py): each request's
bits are torch_native's tree mask (the prefix, then each node's ancestors; under a sliding window counted from each
node's depth), at FlashInfer's per-request offsets; the Triton kernel (interpreted, in a fresh process with
TRITON_INTERPRET=1) writes the same bytes. FlashInfer itself runs them in tests/gpu/test_flashinfer_trees_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import torch

from treadle.core.speculative.tree import TreeLayout
from treadle.kernels.tree_mask import pack_tree_mask, pack_tree_mask_reference, tree_mask_bytes
from treadle.plugins.attention.torch_native import _tree_mask

# Two requests of t = 5: root -> 0, 1; 0 -> 2; 1 -> 3 (the second a chain); 13 and 6 keys (prefixes of 8 and 1).
PARENTS = torch.tensor([[-1, -1, 0, 1], [-1, 0, 1, 2]])
SEQ_LENS = torch.tensor([13, 6])


def unpacked(packed: torch.Tensor, t: int, seq_lens: torch.Tensor) -> list[torch.Tensor]:
    bits = ((packed[:, None].to(torch.int32) >> torch.arange(8)) & 1).flatten().bool()
    rows, start = [], 0
    for length in seq_lens.tolist():
        rows.append(bits[start * 8:start * 8 + t * length].view(t, length))
        start += t * length  # FlashInfer's offset of the next request: elements, read as bytes
    return rows


def test_each_requests_bits_are_torch_natives_tree_mask():
    ancestors = TreeLayout.by_squaring(PARENTS).ancestors
    for window in (None, 3):
        packed = pack_tree_mask_reference(ancestors, SEQ_LENS, window)
        assert packed.numel() == tree_mask_bytes(5, SEQ_LENS) == 5 * 13 + (5 * 6 + 7) // 8
        for b, rows in enumerate(unpacked(packed, 5, SEQ_LENS)):
            assert torch.equal(rows, _tree_mask(int(SEQ_LENS[b]) - 5, ancestors[b], window)), (b, window)


def test_the_kernel_writes_the_reference_bytes_interpreted():
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "ok"


if __name__ == "__main__":
    ancestors = TreeLayout.by_squaring(PARENTS).ancestors
    for window in (None, 3):
        expected = pack_tree_mask_reference(ancestors, SEQ_LENS, window)
        out = torch.full((expected.numel() + 4,), 0xAB, dtype=torch.uint8)
        pack_tree_mask(ancestors.to(torch.uint8), SEQ_LENS, out, window)
        # Each request's bits; the bytes between segments are never read.
        for got, want in zip(unpacked(out, 5, SEQ_LENS), unpacked(expected, 5, SEQ_LENS)):
            assert torch.equal(got, want), (window, got, want)
        assert out[expected.numel():].eq(0xAB).all()
    print("ok")
