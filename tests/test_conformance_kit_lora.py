"""``check_lora_backend`` accepts a backend that does LoRA's arithmetic and names what a broken one gets wrong."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from treadle.core.lora.backend import LoRABackend
from treadle.testing import check_lora_backend


class EinsumBackend(LoRABackend):
    """The contract's arithmetic written plainly (gathering each token's slot), as a third-party backend would."""

    def __init__(self, max_slots: int, max_rank: int, device, dtype) -> None:
        self.max_rank = max_rank

    def shrink(self, x, a, adapter_ids, scalings, ranks):
        slots = adapter_ids.clamp(min=0)
        h = torch.einsum("ti,tri->tr", x.float(), a[slots].float()) * scalings[slots, None]
        return (h * (adapter_ids >= 0)[:, None]).to(x.dtype)

    def expand(self, h, b, adapter_ids, ranks, out):
        slots = adapter_ids.clamp(min=0)
        delta = torch.einsum("tr,tor->to", h.float(), b[slots].float())
        keep = (adapter_ids >= 0)[:, None]
        out.copy_(torch.where(keep, out.float() + delta, out.float()).to(out.dtype))


class IgnoresScalings(EinsumBackend):
    def shrink(self, x, a, adapter_ids, scalings, ranks):
        return super().shrink(x, a, adapter_ids, torch.ones_like(scalings), ranks)


class DeltaForEveryRow(EinsumBackend):
    """Treats NO_ADAPTER as slot 0 in the expand (a clamp without the mask)."""

    def expand(self, h, b, adapter_ids, ranks, out):
        out += torch.einsum("tr,tor->to", h.float(), b[adapter_ids.clamp(min=0)].float()).to(out.dtype)


class LosesStridedOut(EinsumBackend):
    """Adds into a contiguous copy when ``out`` is a column slice, so the caller's tensor never changes."""

    def expand(self, h, b, adapter_ids, ranks, out):
        super().expand(h, b, adapter_ids, ranks, out.contiguous() if not out.is_contiguous() else out)


class OneScalingPerLayer(EinsumBackend):
    """A stacked layer's projections all scaled by the first one's scalings."""

    def add_delta(self, x, weights, adapter_ids, out):
        first = weights.scalings[:1].expand_as(weights.scalings)
        super().add_delta(x, dataclasses.replace(weights, scalings=first), adapter_ids, out)


class WarmUpWritesTheWeights(EinsumBackend):
    """A warm-up that uses the layer's own ``a`` as its scratch output."""

    def warm_up(self, layers, max_tokens):
        for weights in layers:
            weights.a.zero_()
        return len(layers)


class NotABackend:
    def __init__(self, *args) -> None:
        pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_arithmetic_passes(dtype: torch.dtype) -> None:
    check_lora_backend(EinsumBackend, "cpu", dtype)


@pytest.mark.parametrize(("backend", "message"), [
    (IgnoresScalings, "shrink: differs from the reference arithmetic"),
    (DeltaForEveryRow, "changed rows of tokens without an adapter"),
    (LosesStridedOut, "expand into a strided column slice: differs from the reference"),
    (OneScalingPerLayer, "add_delta, 1 tokens\\): differs from the reference"),
    (WarmUpWritesTheWeights, "warm_up\): changed the layers' weights"),
    (NotABackend, "not a LoRABackend"),
])
def test_broken_backend_is_named(backend, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_lora_backend(backend, "cpu", torch.float32)
