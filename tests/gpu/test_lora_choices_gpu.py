"""The ``triton`` LoRA backend's ``add_delta`` under the ``LoRAKernelChoice`` tunables that ``treadle bench lora
--sweep`` times (kernels/lora_choice.py: the PDL go-ahead, tiles, split-K reach, the dense form) at Llama-3.1-8B's
stacked shapes against the ``torch`` backend, and captured in a CUDA graph then replayed with other adapter ids."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SLOTS = 8
NO_ADAPTER = -1
# Llama-3.1-8B's fused layers: (in, projection widths)
LAYERS = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}


# The default (go-ahead on; the sorted form past 64 tokens), the hand-over before it, the sweep's widest tiles and
# widest split-K reach, the unsorted forms at every size, and the sorted form's other shapes (bench/lora_kernels.py
# SWEEP_CHOICES), the dense form (cuBLAS over every slot) past 1 token and never (the default takes it past 128), and
# the gather shrink at 32 tokens: the full-row form, the looped form (the default) with in split over more
# slices, in registers ahead and through Triton's pipeline.
CHOICES = ({}, {"go_ahead": 0}, {"shrink_tile": 16384, "expand_tile": 16384},
           {"busy_programs": 1024, "split_k": 1024}, {"sort_above": 1 << 20},
           {"sort_programs": 256, "sort_columns": 128}, {"sort_columns": 512}, {"dense_above": 1},
           {"dense_above": 1 << 20}, {"shrink_loop_above": 1 << 20},
           {"shrink_loop_rows": 8, "shrink_loop_k": 1024, "shrink_loop_programs": 1024, "shrink_loop_stages": 1},
           {"shrink_loop_stages": 3},
           {"expand_tile": 16384, "expand_max_warps": 8, "expand_wide_above": 8192, "expand_wide_tile": 4096})


def _choices():
    from treadle.kernels.lora_choice import LoRAKernelChoice

    return [LoRAKernelChoice(**fields) for fields in CHOICES]


def _stacked(in_features: int, widths: tuple[int, ...], max_rank: int, seed: int):
    from treadle.core.lora.backend import StackedLoRA

    gen = torch.Generator(device="cuda").manual_seed(seed)
    count = len(widths)
    ranks = torch.tensor([[16, 8, 0, 16, 1, 12, 16, 4]] * count, dtype=torch.int32, device="cuda")
    ranks[-1, 2] = max_rank  # a slot that changes only the last projection
    a = torch.randn(SLOTS, count * max_rank, in_features, device="cuda", generator=gen) / in_features ** 0.5
    b = torch.randn(SLOTS, sum(widths), max_rank, device="cuda", generator=gen) / max_rank ** 0.5
    segments, start = [], 0
    for p, width in enumerate(widths):
        segments.append((start, start + width))
        for slot in range(SLOTS):
            rank = int(ranks[p, slot])
            a[slot, p * max_rank + rank:(p + 1) * max_rank] = 0
            b[slot, start:start + width, rank:] = 0
        start += width
    scalings = torch.linspace(0.5, 2.0, SLOTS * count, device="cuda").view(count, SLOTS)
    return StackedLoRA(a.bfloat16(), b.bfloat16(), scalings, ranks, tuple(segments)).with_dense_b()


def _ids(num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(NO_ADAPTER, SLOTS, (num_tokens,), generator=gen).to("cuda")


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("num_tokens", [1, 32, 256])
def test_every_choice_matches_torch_backend(layer: str, num_tokens: int) -> None:
    from treadle.plugins.lora_backends.torch import TorchLoRABackend
    from treadle.plugins.lora_backends.triton import TritonLoRABackend

    in_features, widths = LAYERS[layer]
    weights = _stacked(in_features, widths, 16, seed=num_tokens)
    x = torch.randn(num_tokens, in_features, device="cuda").bfloat16()
    ids = _ids(num_tokens, seed=num_tokens)
    out = torch.randn(num_tokens, sum(widths), device="cuda").bfloat16()
    expected = out.float().clone()
    TorchLoRABackend(SLOTS, 16, "cuda", torch.float32).add_delta(x.float(), _float(weights), ids, expected)
    backend = TritonLoRABackend(SLOTS, 16, "cuda", torch.bfloat16)
    for choice in _choices():
        backend.kernel_choice = choice
        got = out.clone()
        backend.add_delta(x, weights, ids, got)
        torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=2e-2, msg=lambda m: f"{choice.name}: {m}")
        assert torch.equal(got[ids == NO_ADAPTER], out[ids == NO_ADAPTER]), choice.name


@pytest.mark.parametrize("num_tokens", [1, 32, 256])
def test_every_choice_replays_from_a_graph_with_other_ids(num_tokens: int) -> None:
    """Two layers back to back, the second's input the first's output (its shrink right after the first's expand,
    which lets it start early under the go-ahead): replayed with other ids, both equal the eager calls and the
    ``torch`` backend's."""
    from treadle.plugins.lora_backends.torch import TorchLoRABackend
    from treadle.plugins.lora_backends.triton import TritonLoRABackend

    in_features, widths = LAYERS["qkv"]
    first, second = _stacked(in_features, widths, 16, seed=3), _stacked(in_features, widths, 16, seed=4)
    backend = TritonLoRABackend(SLOTS, 16, "cuda", torch.bfloat16)
    reference = TorchLoRABackend(SLOTS, 16, "cuda", torch.float32)
    x = torch.randn(num_tokens, in_features, device="cuda").bfloat16()
    ids = _ids(num_tokens, seed=1)
    out = torch.zeros(num_tokens, sum(widths), device="cuda").bfloat16()
    out2 = torch.zeros_like(out)
    for choice in _choices():
        backend.kernel_choice = choice

        def step() -> None:
            out.zero_()
            out2.zero_()
            backend.add_delta(x, first, ids, out)
            backend.add_delta(out[:, :in_features], second, ids, out2)

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for seed in range(2, 4):
            ids.copy_(_ids(num_tokens, seed=seed))
            graph.replay()
            replayed, replayed2 = out.clone(), out2.clone()
            step()
            assert torch.equal(replayed, out) and torch.equal(replayed2, out2), \
                f"{choice.name}: replay differs from the eager call"
            expected2 = torch.zeros_like(out2, dtype=torch.float32)
            reference.add_delta(replayed[:, :in_features].float(), _float(second), ids, expected2)
            torch.testing.assert_close(replayed2.float(), expected2, atol=5e-2, rtol=2e-2,
                                       msg=lambda m: f"{choice.name}: {m}")


def _float(weights):
    from treadle.core.lora.backend import StackedLoRA

    return StackedLoRA(weights.a.float(), weights.b.float(), weights.scalings, weights.ranks, weights.segments)
