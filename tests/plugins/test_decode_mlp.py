"""The one-token MLP-step kernel (o_proj through the next layer's norm, ``decode_mlp_kernels``) under the Triton
interpreter, phase by phase, on FP8 weights with per-row scales and on 16-bit weights, against a torch reference
that rounds where the separate kernels round; and when the layers choose it.

The interpreter runs programs one after another, so the grid-wide waits of the one-launch form run only on a GPU
(``tests/gpu/test_fp8_gpu.py``); here each phase is its own launch, the same code between the waits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

# Small tiles (block_n 4, block_k 64, gate_up block_n 4, 4 warps, 1 stage) so the sizes below take several tiles
# and K steps per program, and 3 programs, which share the tiles unevenly.
TILES = "4:64:4:4:1"
# float16 rounds as on a GPU (the steps round where the reference does); the interpreter truncates bfloat16.
MAX_RELATIVE_ERROR = {"float16": 2e-3, "bfloat16": 5e-2}

CHECKS = r"""
import json
import torch
from treadle.plugins.models.decode_mlp_kernels import DecodeMlpWeights, counters, decode_mlp
from treadle.plugins.models.fp8_ops import dequantize, quantize_per_channel
from treadle.plugins.models.fused_ops import rmsnorm_reference

def reference(x, residual, w, dequantized):
    o, gate_up, down = dequantized
    dtype = x.dtype
    summed = ((x.float() @ o.t()).to(dtype).float() + residual.float()).to(dtype)
    gate, up = (rmsnorm_reference(summed, w.post_norm, w.post_eps).float() @ gate_up.t()).chunk(2, dim=-1)
    g = gate.to(dtype).float()
    act = ((g / (1 + torch.exp(-g))).to(dtype).float() * up.to(dtype).float()).to(dtype)
    out = ((act.float() @ down.t()).to(dtype).float() + summed.float()).to(dtype)
    return rmsnorm_reference(out, w.next_norm, w.next_eps), out

errors = {}
gen = torch.Generator().manual_seed(0)
hidden, k_o, inter = 128, 192, 320
for dtype in (torch.float16, torch.bfloat16):
    dense = [torch.randn(n, k, generator=gen) * 0.1 for n, k in ((hidden, k_o), (2 * inter, hidden), (hidden, inter))]
    norms = [(torch.rand(hidden, generator=gen) + 0.5).to(dtype) for _ in range(2)]
    x = torch.randn(1, k_o, generator=gen).to(dtype)
    residual = torch.randn(1, hidden, generator=gen).to(dtype)
    for kind in ("fp8", "16bit"):
        if kind == "fp8":
            quantized = [quantize_per_channel(d) for d in dense]
            dequantized = [dequantize(q, s, torch.float32) for q, s in quantized]
        else:
            quantized = [(d.to(dtype), None) for d in dense]
            dequantized = [d.to(dtype).float() for d in dense]
        (o, o_s), (gu, gu_s), (dn, dn_s) = quantized
        weights = DecodeMlpWeights(o, o_s, norms[0], 1e-5, gu, gu_s, dn, dn_s, norms[1], 1e-6)
        normed, out = decode_mlp(x, residual, weights, programs=3)
        expected_normed, expected_out = reference(x, residual, weights, dequantized)
        ok = normed.shape == out.shape == (1, hidden) and normed.dtype == out.dtype == dtype
        for name, got, want in (("normed", normed, expected_normed), ("residual", out, expected_out)):
            error = ((got.float() - want.float()).norm() / want.float().norm()).item() if ok else float("inf")
            errors[f"{kind}-{str(dtype)[6:]}-{name}"] = error
errors["counters left nonzero"] = sum(int(c.count_nonzero()) for c in [counters(torch.device("cpu"))])
print("RESULTS " + json.dumps(errors))
"""


@pytest.fixture(scope="module")
def relative_errors() -> dict[str, float]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "TREADLE_DECODE_MLP_TILES": TILES}
    proc = subprocess.run([sys.executable, "-c", CHECKS], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


@pytest.mark.parametrize("kind", ["fp8", "16bit"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("output", ["normed", "residual"])
def test_decode_mlp_matches_the_separate_steps(relative_errors, kind, dtype, output):
    assert relative_errors[f"{kind}-{dtype}-{output}"] < MAX_RELATIVE_ERROR[dtype]


def test_decode_mlp_leaves_its_counters_at_zero(relative_errors):
    # The last program resets the counts; a leftover one would release the next layer's wait early.
    assert relative_errors["counters left nonzero"] == 0


def test_tiles_must_cover_the_sizes():
    from treadle.plugins.models.decode_mlp_kernels import FP8_TILES, SIXTEEN_BIT_TILES, fits

    for tiles in (FP8_TILES, SIXTEEN_BIT_TILES):
        assert fits(tiles, 4096, 4096, 14336)  # Llama-3.1-8B
        assert not fits(tiles, 4096, 4096, 14336 + 8)


def test_layers_on_the_cpu_run_the_separate_kernels():
    """No layer chose a Triton GEMV on the CPU, so the step is not fused (the model's forward runs as before)."""
    from types import SimpleNamespace

    from treadle.plugins.models.decode_mlp import fused_mlp_step
    from treadle.plugins.models.layers import GatedMLP, RMSNorm
    from treadle.plugins.models.linear import RowParallelLinear

    o_proj, mlp, norm = RowParallelLinear(64, 64), GatedMLP(64, 128), RMSNorm(64)
    attended, residual = torch.randn(1, 64), torch.randn(1, 64)
    assert fused_mlp_step(attended, residual, o_proj, norm, mlp, norm) is None
    # Even with GEMVs chosen, two tokens are not one.
    gemv = SimpleNamespace(for_rows=lambda rows: SimpleNamespace(gemv=True))
    for layer in (o_proj, mlp.gate_up_proj, mlp.down_proj):
        layer.small_batch = gemv
    assert fused_mlp_step(torch.randn(2, 64), torch.randn(2, 64), o_proj, norm, mlp, norm) is None
