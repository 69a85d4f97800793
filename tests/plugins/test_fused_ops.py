"""The fused Triton kernels of the decoder layers equal their PyTorch references.

Triton runs on the CPU only through its interpreter, which must be switched on
before triton is first imported; the checks run in a fresh subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CHECKS = r'''
import json, torch
from treadle.kernels import fused as K
from treadle.kernels import fused_ops as R

torch.manual_seed(0)
results = {}
for dtype in (torch.float32, torch.float16):
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    x = torch.randn(5, 96, dtype=dtype)
    residual = torch.randn(5, 96, dtype=dtype)
    weight = torch.rand(96, dtype=dtype) + 0.5
    out, summed = K.add_rmsnorm(x, residual, weight, 1e-6)
    ref_out, ref_sum = R.add_rmsnorm(x, residual, weight, 1e-6)
    first, _ = K.add_rmsnorm(x, None, weight, 1e-6)
    results[f"add_rmsnorm_{dtype}"] = max((out - ref_out).abs().max().item(), (summed - ref_sum).abs().max().item(),
                                          (first - R.rmsnorm_reference(x, weight, 1e-6)).abs().max().item()) <= tol

    heads, kv_heads, dim = 6, 2, 16
    qkv = torch.randn(4, (heads + 2 * kv_heads) * dim, dtype=dtype)
    angles = torch.randn(4, 1, dim // 2).repeat(1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = K.rotary_qkv(qkv, cos, sin, heads, kv_heads, dim)
    qkv_ref = qkv.clone()
    q, k, v = qkv_ref.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    want = (R.apply_rotary_reference(q.reshape(-1, heads, dim), cos, sin).reshape(4, -1),
            R.apply_rotary_reference(k.reshape(-1, kv_heads, dim), cos, sin).reshape(4, -1), v)
    results[f"rotary_qkv_{dtype}"] = all((g - w).abs().max().item() <= tol for g, w in zip(got, want))
    # Column-major tables (a transposed product, as M-RoPE's once were) rotate by the same angles.
    strided_cos, strided_sin = (t.reshape(4, dim).t().contiguous().t()[:, None, :] for t in (cos, sin))
    strided = K.rotary_qkv(qkv, strided_cos, strided_sin, heads, kv_heads, dim)
    results[f"rotary_qkv_strided_{dtype}"] = all(torch.equal(g, w) for g, w in zip(strided, got))

    # The vision encoders' rotary: float32 math rounded once; head_dim 80 (Qwen2.5-VL's: half not a power of 2).
    for vision_heads, vision_dim in ((3, 80), (2, 16)):
        qkv = torch.randn(5, 3 * vision_heads * vision_dim, dtype=dtype)
        angles = torch.randn(5, vision_dim // 2).repeat(1, 2)
        got = torch.cat(K.rotary_qk_float32(qkv, angles.cos(), angles.sin(), vision_heads), dim=1)
        want = torch.cat(R.rotary_qk_float32(qkv, angles.cos(), angles.sin(), vision_heads), dim=1)
        results[f"rotary_qk_float32_{dtype}"] = results.get(f"rotary_qk_float32_{dtype}", True) and (
            got.dtype == want.dtype and (got.float() - want.float()).abs().max().item() <= tol)

    gate_up = torch.randn(3, 2 * 1500, dtype=dtype)
    results[f"silu_mul_{dtype}"] = (K.silu_mul(gate_up) - R.silu_mul(gate_up)).abs().max().item() <= tol
print("RESULTS " + json.dumps(results))
'''


@pytest.fixture(scope="module")
def kernel_results():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECKS], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


@pytest.mark.parametrize("op", ["add_rmsnorm", "rotary_qkv", "rotary_qkv_strided", "rotary_qk_float32", "silu_mul"])
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.float16"])
def test_kernel_matches_reference(kernel_results, op, dtype):
    assert kernel_results[f"{op}_{dtype}"]


def test_cpu_tensors_use_the_reference_path():
    import torch

    from treadle.kernels import fused_ops

    gate_up = torch.randn(2, 8)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fused_ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
