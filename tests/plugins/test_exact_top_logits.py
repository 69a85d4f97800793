"""Each row's best logits of an FP8 head recomputed from the 16-bit weight (layers/exact_top_logits.py):
the torch path, and the Triton kernels under the interpreter against it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from treadle.layers.exact_top_logits import recompute_top_logits


def _case(rows: int, vocab: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=generator).to(dtype)
    weight = torch.randn(vocab, hidden, generator=generator).to(dtype)
    approximate = (x.float() @ weight.float().t() + 0.05 * torch.randn(rows, vocab, generator=generator)).to(dtype)
    return approximate, x, weight


def test_the_k_best_logits_of_each_row_become_the_16_bit_products():
    approximate, x, weight = _case(rows=5, vocab=300, hidden=64, dtype=torch.float32)
    logits = approximate.clone()
    recompute_top_logits(logits, x, weight, 8)
    exact = x @ weight.t()
    best = approximate.topk(8, dim=-1).indices
    changed = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, best, True)
    assert torch.allclose(logits[changed], exact[changed], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[~changed], approximate[~changed])  # the rest keep the approximate values
    assert not torch.allclose(approximate[changed], exact[changed], atol=1e-3)  # so the test sees the rewrite
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))


def test_k_larger_than_the_vocabulary_and_empty_batches():
    approximate, x, weight = _case(rows=2, vocab=6, hidden=16, dtype=torch.float32)
    logits = approximate.clone()
    recompute_top_logits(logits, x, weight, 8)
    assert torch.allclose(logits, x @ weight.t(), rtol=1e-5, atol=1e-5)
    recompute_top_logits(logits[:0], x[:0], weight, 8)


_KERNEL_CHECK = r"""
import torch
from treadle.kernels import exact_top_logits as kernels

def case(rows, vocab, hidden, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    w = torch.randn(vocab, hidden, generator=g).to(dtype)
    approximate = (x.float() @ w.float().t() + 0.5 * torch.randn(rows, vocab, generator=g)).to(dtype)
    return approximate, x, w

# A vocabulary that is not a multiple of the chunk, one chunk with fewer than k columns, ties, and bfloat16.
for rows, vocab, hidden, dtype, k in ((3, 2 * kernels._CHUNK + 5, 96, torch.float32, 8),
                                      (2, 4100, 64, torch.bfloat16, 4), (1, 7, 16, torch.float32, 7)):
    approximate, x, w = case(rows, vocab, hidden, dtype, rows + k)
    if vocab > 100:
        approximate[0, 10:13] = approximate[0].max() + 1  # three equal maxima
    logits = approximate.clone()
    kernels.recompute_top_logits(logits, x, w, k)
    assert not torch.equal(logits, approximate)
    best = approximate.float().topk(k, dim=-1).indices
    changed = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, best, True)
    exact = (x.float() @ w.float().t()).to(dtype)
    assert torch.equal(logits[~changed], approximate[~changed]), "a column outside the best k changed"
    assert torch.allclose(logits[changed].float(), exact[changed].float(), rtol=1e-2 if dtype != torch.float32 else 1e-5,
                          atol=1e-4), (logits[changed], exact[changed])
print("OK")
"""


def test_kernels_rewrite_the_same_columns_under_the_triton_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
