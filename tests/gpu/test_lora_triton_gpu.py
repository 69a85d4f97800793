"""The `triton` LoRA backend on the GPU: the conformance kit (CUDA-graph replay included), Llama-3.1-8B's projection
shapes against float32 torch arithmetic at decode and prefill sizes, and shrink + expand of a fused qkv output
captured in CUDA graphs and replayed with other adapter ids."""

from __future__ import annotations

import pytest
import torch

from treadle.testing import check_lora_backend

pytestmark = pytest.mark.gpu

NO_ADAPTER = -1
SLOTS = 8
# Llama-3.1-8B: (in, out) of each sub-projection a backend call sees
PROJECTIONS = {"q": (4096, 4096), "kv": (4096, 1024), "o": (4096, 4096), "gate_up": (4096, 14336),
               "down": (14336, 4096)}


def _backend(max_rank: int, dtype: torch.dtype):
    from treadle.plugins.lora_backends.triton import TritonLoRABackend

    return TritonLoRABackend(SLOTS, max_rank, "cuda", dtype)


def _adapters(in_features: int, out_features: int, max_rank: int, ranks: list[int], dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(SLOTS, max_rank, in_features, device="cuda", generator=gen) / in_features ** 0.5
    b = torch.randn(SLOTS, out_features, max_rank, device="cuda", generator=gen) / max_rank ** 0.5
    for slot, rank in enumerate(ranks):
        a[slot, rank:] = 0
        b[slot, :, rank:] = 0
    scalings = torch.linspace(0.5, 2.0, SLOTS, device="cuda")
    return a.to(dtype), b.to(dtype), scalings, torch.tensor(ranks, dtype=torch.int32, device="cuda")


def _ids(num_tokens: int, layout: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if layout == "distinct":  # decode: every token another adapter (or none)
        ids = torch.randint(-1, SLOTS, (num_tokens,), generator=gen)
    elif layout == "none":
        ids = torch.full((num_tokens,), NO_ADAPTER)
    elif layout == "one":  # one adapter for every token
        ids = torch.full((num_tokens,), 3)
    else:  # prefill: requests of 100-1000 tokens, each one adapter (or none)
        runs: list[torch.Tensor] = []
        while sum(len(run) for run in runs) < num_tokens:
            runs.append(torch.full((int(torch.randint(100, 1000, (1,), generator=gen)),),
                                   int(torch.randint(-1, SLOTS, (1,), generator=gen))))
        ids = torch.cat(runs)[:num_tokens]
    return ids.to("cuda")


def _reference(x, a, b, ids, scalings, ranks, out):
    """(h, out + delta) in float32, one masked matmul per slot."""
    h = torch.zeros(x.shape[0], a.shape[1], device="cuda")
    result = out.float().clone()
    for slot in range(SLOTS):
        rows = ids == slot
        rank = int(ranks[slot])
        h[rows, :rank] = scalings[slot] * (x[rows].float() @ a[slot, :rank].float().T)
    h16 = h.to(x.dtype)
    for slot in range(SLOTS):
        rows = ids == slot
        rank = int(ranks[slot])
        result[rows] += h16[rows, :rank].float() @ b[slot, :, :rank].float().T
    return h, result


def _replays_match_eager(step, x: torch.Tensor, ids: torch.Tensor, out: torch.Tensor):
    """Capture ``step`` in a CUDA graph, then for each layout of ids (each token another adapter, none, prefill-like
    runs, one request's adapter) with new inputs: the replay's ``out`` equals the eager call's; yields the layout
    after each (``ids``, ``x`` and ``out`` hold that call's)."""
    step()  # compiles outside the capture (Triton kernels only: no cuBLAS state to warm on a side stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed, layout in enumerate(["distinct", "none", "prefill", "one"]):
        ids.copy_(_ids(ids.shape[0], layout, seed=seed + 10))
        x.copy_(torch.randn_like(x, dtype=torch.float32).to(x.dtype))
        graph.replay()
        replayed = out.clone()
        step()
        assert torch.equal(replayed, out), f"replay with {layout} ids differs from the eager call"
        yield layout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_conformance_kit(dtype: torch.dtype) -> None:
    check_lora_backend("triton", "cuda", dtype)


@pytest.mark.parametrize("projection", list(PROJECTIONS))
@pytest.mark.parametrize(("num_tokens", "layout", "max_rank"), [
    (1, "distinct", 64), (32, "distinct", 64), (64, "distinct", 64),  # gather
    (200, "distinct", 16),  # gather shrink (up to 4096 // max_rank tokens), slot-grouped expand
    (65, "distinct", 64), (600, "distinct", 64),  # segmented shrink, slot-grouped expand
    (1500, "distinct", 64), (2048, "prefill", 64), (8192, "prefill", 64),  # segmented
])
def test_real_shapes_match_torch(projection: str, num_tokens: int, layout: str, max_rank: int) -> None:
    in_features, out_features = PROJECTIONS[projection]
    ranks = [min(rank, max_rank) for rank in (16, 64, 8, 32, 1, 16, 48, 16)]
    a, b, scalings, rank_tensor = _adapters(in_features, out_features, max_rank, ranks, torch.bfloat16, seed=1)
    ids = _ids(num_tokens, layout, seed=num_tokens)
    x = torch.randn(num_tokens, in_features, device="cuda").to(torch.bfloat16)
    out = torch.randn(num_tokens, out_features, device="cuda").to(torch.bfloat16)
    expected_h, expected_out = _reference(x, a, b, ids, scalings, rank_tensor, out)
    backend = _backend(max_rank, torch.bfloat16)
    h = backend.shrink(x, a, ids, scalings, rank_tensor)
    torch.testing.assert_close(h.float(), expected_h, atol=2e-2, rtol=2e-2)
    backend.expand(h, b, ids, rank_tensor, out)
    torch.testing.assert_close(out.float(), expected_out, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("num_tokens", [1, 32, 512])
def test_graph_replay_with_changing_adapters(num_tokens: int) -> None:
    """q, k and v deltas expanded into column slices of one qkv output, captured once, replayed with other ids
    (each token another adapter, one request's adapter, none, prefill-like runs) and other inputs."""
    dtype, max_rank, ranks = torch.bfloat16, 32, [16, 32, 8, 16, 4, 16, 16, 1]
    widths = (4096, 1024, 1024)
    pieces = [_adapters(4096, width, max_rank, ranks, dtype, seed=i) for i, width in enumerate(widths)]
    backend = _backend(max_rank, dtype)
    x = torch.randn(num_tokens, 4096, device="cuda").to(dtype)
    ids = _ids(num_tokens, "distinct", seed=0)
    qkv = torch.empty(num_tokens, sum(widths), device="cuda", dtype=dtype)
    base = torch.randn_like(qkv)

    def step() -> None:
        qkv.copy_(base)
        start = 0
        for (a, b, scalings, rank_tensor), width in zip(pieces, widths):
            h = backend.shrink(x, a, ids, scalings, rank_tensor)
            backend.expand(h, b, ids, rank_tensor, qkv[:, start:start + width])
            start += width

    for _ in _replays_match_eager(step, x, ids, qkv):
        start = 0
        for (a, b, scalings, rank_tensor), width in zip(pieces, widths):
            _, expected = _reference(x, a, b, ids, scalings, rank_tensor, base[:, start:start + width])
            torch.testing.assert_close(qkv[:, start:start + width].float(), expected, atol=3e-2, rtol=2e-2)
            start += width


# Llama-3.1-8B's fused layers: input width, and the output widths of their stacked projections
FUSED = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
         "down": (14336, (4096,))}


def _stacked(in_features: int, widths: tuple[int, ...], max_rank: int, dtype: torch.dtype):
    """A StackedLoRA of ``widths`` projections, each slot's rank differing per projection (0: none)."""
    from treadle.core.lora.backend import StackedLoRA

    pieces = [_adapters(in_features, width, max_rank, [min(r, max_rank) for r in ranks], dtype, seed=p)
              for p, (width, ranks) in enumerate(zip(widths, ([16, 64, 8, 32, 1, 16, 48, 16],
                                                              [0, 16, 64, 8, 16, 4, 16, 2],
                                                              [64, 0, 16, 16, 8, 32, 1, 16])))]
    starts = [sum(widths[:p]) for p in range(len(widths))]
    weights = StackedLoRA(torch.cat([a for a, *_ in pieces], dim=1), torch.cat([b for _, b, *_ in pieces], dim=1),
                          torch.stack([s for *_, s, _ in pieces]), torch.stack([r for *_, r in pieces]),
                          tuple((start, start + width) for start, width in zip(starts, widths)))
    return weights, pieces


@pytest.mark.parametrize("fused", list(FUSED))
@pytest.mark.parametrize(("num_tokens", "layout"), [
    (1, "distinct"), (4, "distinct"),  # split-K gather shrink, gather expand
    (32, "distinct"), (64, "one"),  # gather
    (200, "distinct"), (1500, "prefill"),  # add_delta's sorted form (the two-call shrink/expand: grouped, segmented)
])
@pytest.mark.parametrize("dense_b", [False, True])  # with the dense copy of B: the dense form past 128 tokens
def test_stacked_layers_match_torch(fused: str, num_tokens: int, layout: str, dense_b: bool) -> None:
    """add_delta on a fused layer (one shrink, one expand into its output) against each projection's float32
    reference in its columns."""
    in_features, widths = FUSED[fused]
    dtype, max_rank = torch.bfloat16, 64
    weights, pieces = _stacked(in_features, widths, max_rank, dtype)
    weights = weights.with_dense_b() if dense_b else weights
    ids = _ids(num_tokens, layout, seed=num_tokens)
    x = torch.randn(num_tokens, in_features, device="cuda").to(dtype)
    out = torch.randn(num_tokens, sum(widths), device="cuda").to(dtype)
    before = out.clone()
    _backend(max_rank, dtype).add_delta(x, weights, ids, out)
    for (a, b, scalings, ranks), (start, end) in zip(pieces, weights.segments):
        _, expected = _reference(x, a, b, ids, scalings, ranks, before[:, start:end])
        torch.testing.assert_close(out[:, start:end].float(), expected, atol=3e-2, rtol=2e-2)
    assert torch.equal(out[ids == NO_ADAPTER], before[ids == NO_ADAPTER])


@pytest.mark.parametrize("num_tokens", [1, 32, 512])
def test_stacked_graph_replay_with_changing_adapters(num_tokens: int) -> None:
    """add_delta of a fused qkv captured once, replayed with other ids and inputs: what the eager call gives (512
    tokens: the dense form, its mask built from the captured ids)."""
    dtype, max_rank = torch.bfloat16, 32
    weights, _ = _stacked(4096, (4096, 1024, 1024), max_rank, dtype)
    weights = weights.with_dense_b()
    backend = _backend(max_rank, dtype)
    x = torch.randn(num_tokens, 4096, device="cuda").to(dtype)
    ids = _ids(num_tokens, "distinct", seed=0)
    base = torch.randn(num_tokens, 6144, device="cuda").to(dtype)
    qkv = torch.empty_like(base)

    def step() -> None:
        qkv.copy_(base)
        backend.add_delta(x, weights, ids, qkv)

    for _ in _replays_match_eager(step, x, ids, qkv):
        pass
