"""The fused-MoE kernels for integer experts (kernels/packed_int_moe.py) under TRITON_INTERPRET=1 against the torch
reference (layers/int_experts.py), which dequantizes each expert as it runs: the decode GEMVs (fewer assignments
than experts) and the grouped GEMM over rows sorted by expert, with and without zero points."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

RESULT_MARKER = "INT-MOE-RESULTS:"
CASES = [(4, 32, True), (4, 128, False)]  # (bits, group, zero points)
TOKENS = (1, 5)  # 2 and 10 assignments of 4 experts: the GEMVs, then the grouped GEMM


def _check() -> dict[str, float]:
    import torch

    from treadle.kernels.packed_int_moe import fused_int_experts
    from treadle.layers.int_experts import fused_int_experts_reference
    from treadle.layers.packed_int import IntWeightScheme, pack_panels

    torch.manual_seed(0)
    errors = {}
    num_experts, hidden, inter, top_k = 4, 128, 128, 2
    for bits, group, asym in CASES:
        packed = {}
        for name, (n, k) in {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}.items():
            values = torch.randint(0, 1 << bits, (num_experts, n, k))
            packed[f"{name}_proj"] = torch.stack([pack_panels(v, bits) for v in values])
            packed[f"{name}_scales"] = torch.rand(num_experts, n, k // group) * 0.05 + 0.01
            packed[f"{name}_zeros"] = torch.randint(0, 1 << bits, (num_experts, n, k // group)).float() \
                if asym else None
        experts = SimpleNamespace(int_scheme=IntWeightScheme(bits, group), int_group=group, panels=True,
                                  num_experts=num_experts, **packed)
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden)
            weights, ids = torch.rand(tokens, top_k), torch.stack([torch.randperm(num_experts)[:top_k]
                                                                   for _ in range(tokens)])
            expected = fused_int_experts_reference(x, experts, weights, ids)
            got = fused_int_experts(x, packed["gate_up_proj"], packed["gate_up_scales"], packed["gate_up_zeros"],
                                    packed["down_proj"], packed["down_scales"], packed["down_zeros"], weights, ids,
                                    bits, group)
            errors[f"{bits}-{group}-{asym}-{tokens}"] = ((got - expected).norm() / expected.norm()).item()
    return errors


if __name__ == "__main__":
    print(RESULT_MARKER + json.dumps(_check()))
    sys.exit(0)


@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    from interpreted import interpreted_results

    return interpreted_results(__file__, RESULT_MARKER)


@pytest.mark.parametrize("bits, group, asym", CASES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_int_expert_kernels_match_the_dequantizing_reference(errors, bits, group, asym, tokens):
    assert errors[f"{bits}-{group}-{asym}-{tokens}"] < 1e-5
