"""The KV-write check script shared by tests/core/test_kv_store.py (CPU, Triton interpreter, 16/32-bit caches) and
tests/gpu/test_fp8_gpu.py (CUDA, FP8 caches too); run as ``python -c CHECKS <device>``, prints OK."""

CHECKS = r"""
import sys
import torch
from treadle.kernels.kv_store import store_kv
from treadle.core.memory.pools import KVCache

gen = torch.Generator().manual_seed(0)
device = sys.argv[1]
cases = [(torch.bfloat16, torch.bfloat16, 1.0), (torch.float16, torch.float16, 1.0), (torch.float32, torch.float32, 1.0)]
if device == "cuda":
    cases += [(torch.float8_e4m3fn, torch.bfloat16, 0.37), (torch.float8_e4m3fn, torch.float16, 1.0)]
for cache_dtype, dtype, scale in cases:
    reference = KVCache(40, 1, 2, 3, 16, cache_dtype, "cpu")
    fused = KVCache(40, 1, 2, 3, 16, cache_dtype, device)
    for cache in (reference, fused):
        cache.k_scales[1], cache.v_scales[1] = scale, scale / 2
    # Rows of a wider tensor (non-unit row stride), values past the FP8 range to exercise saturation.
    qkv = (torch.randn(7, 5 * 48, generator=gen) * 300).to(dtype)
    k, v = qkv[:, 96:144], qkv[:, 144:192]
    loc = torch.tensor([5, 1, 33, 2, 40, 17, 9])
    reference.set_kv_buffer(1, loc, k, v)
    store_kv(fused.k_buffers[1], fused.v_buffers[1], loc.to(device), k.to(device), v.to(device), scale, scale / 2)
    for got, want in ((fused.k_buffers[1], reference.k_buffers[1]), (fused.v_buffers[1], reference.v_buffers[1])):
        got, want = got.float().cpu(), want.float()
        assert (got[loc] != 0).any() and bool((got.sum((1, 2)) != 0).sum() <= 7)
        if cache_dtype == torch.float8_e4m3fn:
            one_step = want.abs() * 2.0**-3 + 2.0**-9
            assert bool(((got - want).abs() <= one_step).all()), (cache_dtype, (got - want).abs().max())
            assert (got != want).float().mean() < 0.02
        else:
            assert torch.equal(got, want), cache_dtype
    assert fused.k_buffers[0].float().abs().sum() == 0  # other layers untouched
print("OK")
"""
