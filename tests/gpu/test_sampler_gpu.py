"""The sampler's argmax on the GPU (one Triton launch, kernels/argmax.py) picks what ``torch.argmax`` picks,
ties, NaN and rows of -inf included."""

from __future__ import annotations

import pytest
import torch

from treadle.core.execution.sampler import argmax_last_dim

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("rows", [1, 32, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_matches_torch_argmax_at_llama3_vocab(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    # Small integers: many exact ties, so the tie rule (the lowest index) decides most rows.
    x = torch.randint(0, 8, (rows, 128256), generator=gen, device="cuda").to(dtype)
    x[0, 77_000] = x[0, 90_000] = float("nan")
    x[-1] = float("-inf")
    assert torch.equal(argmax_last_dim(x), torch.argmax(x, dim=-1))
    assert torch.equal(argmax_last_dim(x[:, 3:]), torch.argmax(x[:, 3:], dim=-1))  # rows not contiguous
    noisy = torch.randn(rows, 128256, generator=gen, device="cuda").to(dtype)
    assert torch.equal(argmax_last_dim(noisy), torch.argmax(noisy, dim=-1))


def test_argmax_replays_in_a_cuda_graph_with_new_logits() -> None:
    """The split form's per-row counters are reset by each row's last program: replays with new logits keep
    picking what ``torch.argmax`` picks."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 128256, generator=gen, device="cuda").to(torch.bfloat16)
    argmax_last_dim(x)  # the counters exist before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        picked = argmax_last_dim(x)
    for _ in range(5):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        graph.replay()
        assert torch.equal(picked, torch.argmax(x, dim=-1))
