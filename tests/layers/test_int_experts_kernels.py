"""The fused-MoE kernels for integer experts (kernels/packed_int_moe.py) under TRITON_INTERPRET=1 against the torch
reference (layers/int_experts.py), which dequantizes each expert as it runs: the decode GEMVs (fewer assignments
than experts) and each grouped form over rows sorted by expert — the slot-widening GEMM, the magic-widening one
(its plain-op twin of the inline PTX, fp16 rows) and the experts dequantized into a scratch for the 16-bit grouped
GEMM — with and without zero points; and which form each batch shape takes."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

RESULT_MARKER = "INT-MOE-RESULTS:"
CASES = [(4, 32, True), (4, 128, False)]  # (bits, group, zero points)
TOKENS = (1, 5)  # 2 and 10 assignments of 4 experts: the GEMVs, then the grouped GEMM
# (form, tiles, bits, group, zero points, dtype): the forced grouped forms at 5 tokens.
FORMS = [("dequant", None, 4, 32, True, "float32"), ("dequant", None, 8, 128, False, "float32"),
         ("magic", None, 4, 128, True, "float16"),
         ("magic", (32, 64, False), 4, 128, False, "float16")]


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
    for form, tiles, bits, group, asym, dtype in FORMS:
        errors[f"{form}-{tiles}-{bits}-{asym}"] = _form_error(form, tiles, bits, group, asym, getattr(torch, dtype))
    return errors


def _form_error(form, tiles, bits, group, asym, dtype) -> float:
    import torch

    from treadle.kernels.packed_int_moe import fused_int_experts
    from treadle.kernels.packed_int_moe_magic import GroupedMagicTiles
    from treadle.layers.int_experts import fused_int_experts_reference
    from treadle.layers.packed_int import IntWeightScheme, pack_panels

    num_experts, hidden, inter, top_k, tokens = 4, 128, 128, 2, 5
    packed = {}
    for name, (n, k) in {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}.items():
        values = torch.randint(0, 1 << bits, (num_experts, n, k))
        packed[f"{name}_proj"] = torch.stack([pack_panels(v, bits) for v in values])
        packed[f"{name}_scales"] = (torch.rand(num_experts, n, k // group) * 0.05 + 0.01).to(dtype)
        packed[f"{name}_zeros"] = torch.randint(0, 1 << bits, (num_experts, n, k // group)).to(dtype) \
            if asym else None
    experts = SimpleNamespace(int_scheme=IntWeightScheme(bits, group), int_group=group, panels=True,
                              num_experts=num_experts, **packed)
    x = torch.randn(tokens, hidden).to(dtype)
    weights, ids = torch.rand(tokens, top_k), torch.stack([torch.randperm(num_experts)[:top_k]
                                                           for _ in range(tokens)])
    # The scratch a layer holds (E x I x H: gate/up widens half by half), plus some the widening must not touch.
    scratch = torch.full((num_experts * inter * hidden + 64,), float("nan"), dtype=dtype)
    got = fused_int_experts(x, packed["gate_up_proj"], packed["gate_up_scales"], packed["gate_up_zeros"],
                            packed["down_proj"], packed["down_scales"], packed["down_zeros"], weights, ids, bits, group,
                            scratch, form=form,
                            tiles=GroupedMagicTiles(tiles[0], tiles[1], scaled=tiles[2]) if tiles else None)
    expected = fused_int_experts_reference(x.float(), SimpleNamespace(**{
        **vars(experts), **{key: value.float() for key, value in packed.items()
                            if value is not None and value.is_floating_point()}}), weights, ids)
    assert bool(scratch[-64:].isnan().all())
    return ((got.float() - expected).norm() / expected.norm()).item()


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


@pytest.mark.parametrize("form, tiles, bits, group, asym, dtype", FORMS)
def test_each_grouped_form_matches_the_dequantizing_reference(errors, form, tiles, bits, group, asym, dtype):
    # fp16 rows: the magic form's products and each routed output round to fp16 (the reference here is float32).
    assert errors[f"{form}-{tiles}-{bits}-{asym}"] < (1e-5 if dtype == "float32" else 5e-3)


def test_each_batch_shape_takes_its_form(monkeypatch):
    import torch

    from treadle.kernels.packed_int_moe import choose_form

    def form(tokens, group=128, dtype=torch.bfloat16, scratch=True, experts=8, top_k=2):
        return choose_form(tokens, top_k, experts, 4096, 14336, 4, group, dtype, scratch)

    # Mixtral-8x7B: the GEMVs below one assignment per expert, the magic grouped GEMM, then from 256 rows per expert
    # (1024 tokens) the dequantized experts, where the layer has a scratch.
    assert [form(t) for t in (3, 4, 512, 1023, 1024, 8192)] == ["gemv", "magic", "magic", "magic", "dequant", "dequant"]
    assert form(8192, scratch=False) == "magic"
    # Groups smaller than a panel, or float32 rows: the slot-widening grouped GEMM.
    assert form(64, group=32) == form(64, dtype=torch.float32) == "grouped"
    monkeypatch.setenv("TREADLE_INT_MOE_DEQUANT_ROWS", "0")
    assert form(8192) == "magic"
