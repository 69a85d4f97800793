"""The integer layers' decode kernels prefetch the next weight's head into L2 as the 16-bit ones do: the layer hands
its ``l2_prefetch`` (``small_batch.chain_l2_prefetch``) to every kernel call, and the launch shares its 128-byte
lines among the last programs (``kernels/small_batch.py``'s ``_prefetch_share``, compiled for sm_90 in
test_packed_int_compiles_for_gpu.py; the interpreter cannot run its PTX)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


class _RecordingPlan:
    """Stands in for an IntKernelPlan: records the prefetch each call gets."""

    def __init__(self) -> None:
        self.prefetches: list[object] = []

    def run(self, x, weight, scales, zeros, g_idx, prefetch=None, buffer=None):
        self.prefetches.append(prefetch)
        return torch.zeros(x.shape[0], 4)

    def run_silu_mul(self, x, weight, scales, zeros, prefetch=None):
        self.prefetches.append(prefetch)
        return torch.zeros(x.shape[0], 2)

    def run_add_rmsnorm(self, x, weight, scales, zeros, residual, norm_weight, eps, prefetch=None):
        self.prefetches.append(prefetch)
        return residual, residual


def test_every_kernel_call_of_an_integer_layer_gets_its_l2_prefetch():
    from treadle.layers.packed_int import IntWeightScheme, PackedIntFormat, PackedIntLinearMethod

    plan, head = _RecordingPlan(), torch.zeros(256, dtype=torch.uint8)
    layer = SimpleNamespace(int_kernels=plan, l2_prefetch=head, input_perm=None, g_idx=None, weight=None,
                            weight_scales=None, weight_zeros=None)
    method = PackedIntLinearMethod(PackedIntFormat(IntWeightScheme(4, 128)))
    x = torch.randn(1, 8)
    method.apply(layer, x)
    method.apply(layer, torch.randn(32, 8))
    method.apply_silu_mul(layer, x)
    method.apply_add_rmsnorm(layer, x, torch.zeros(1, 4), torch.ones(4), 1e-6)
    assert len(plan.prefetches) == 4 and all(p is head for p in plan.prefetches)


def test_the_prefetch_lines_are_shared_among_the_last_programs(monkeypatch):
    pytest.importorskip("triton")
    from treadle.kernels import small_batch
    from treadle.kernels.packed_int import prefetch_args

    weight = torch.zeros(4, 4, dtype=torch.int32)
    monkeypatch.setitem(small_batch._prefetching, weight.device, 8)  # the last 8 programs prefetch
    args = prefetch_args(torch.zeros(10 * 128 + 5, dtype=torch.uint8), 20, weight)
    assert (args["prefetch_lines"], args["first_prefetcher"], args["PREFETCH"]) == (10, 12, True)
    assert args["PREFETCH_BLOCK"] == 2  # 10 lines among 8 programs: 2 each, at most
    fewer = prefetch_args(torch.zeros(3000 * 128, dtype=torch.uint8), 5, weight)  # a launch of fewer programs
    assert (fewer["first_prefetcher"], fewer["PREFETCH_BLOCK"]) == (0, 256)
    off = prefetch_args(None, 20, weight)
    assert not off["PREFETCH"] and off["prefetch_ptr"] is weight and off["prefetch_lines"] == 0
