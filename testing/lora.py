"""``check_lora_backend``: does a LoRA backend add each token's adapter delta the way treadle relies on?"""

from __future__ import annotations

from typing import Callable

import torch

from treadle.core.execution.batch_context import NO_ADAPTER
from treadle.core.lora.backend import LoRABackend, StackedLoRA

LoRABackendFactory = Callable[[int, int, "torch.device | str", torch.dtype], LoRABackend]

# Slots of the check's adapters and their ranks (the last slot unused); max_rank pads them.
_RANKS = (16, 8, 3, 1)
_MAX_RANK = 16
_IN_FEATURES = 80  # not a power of two: kernels must mask the tail
_OUT_FEATURES = 48
# A stacked layer's projections (q/k/v-like): their output widths and, per projection, each slot's rank (mixed:
# the first slot leaves the second projection alone).
_STACKED_WIDTHS = (48, 16, 16)
_STACKED_RANKS = ((16, 8, 3, 1), (0, 16, 5, 2), (4, 1, 16, 9))


def check_lora_backend(
    backend: str | LoRABackendFactory,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    token_counts: tuple[int, ...] = (1, 5, 33, 70, 300, 1100),
    stacked_token_counts: tuple[int, ...] | None = None,
    seed: int = 0,
) -> None:
    """Assert that a LoRA backend (a registered name, or a ``factory(max_slots, max_rank, device, dtype)``)
    computes core/lora/backend.py's arithmetic.

    Checked for each number of tokens in ``token_counts`` (decode- to prefill-sized batches of decode tokens with one adapter each and of
    prefill-like runs of tokens sharing one, both with tokens without an adapter), against float64 arithmetic on
    the same inputs, within the dtype's rounding, on adapters of mixed ranks zero-padded to ``max_rank``:

    - ``shrink`` returns ``[T, max_rank]`` in ``x``'s dtype: ``scalings[s] * x[t] @ a[s].T``, rows of
      ``NO_ADAPTER`` tokens exactly zero; it modifies none of its inputs;
    - ``expand`` adds ``h[t] @ b[s].T`` into ``out``, also when ``out`` is a strided column slice of a wider
      tensor: rows of ``NO_ADAPTER`` tokens and the columns outside the slice are left bit for bit;
    - a batch where no token has an adapter adds nothing;
    - ``add_delta`` (for each number of tokens in ``stacked_token_counts``, default ``token_counts``) adds three
      stacked projections' deltas, each slot of its own rank per projection, into their columns of a layer's
      output in place: rows of ``NO_ADAPTER`` tokens and the columns outside the projections left bit for bit
      (the weights carry ``dense_b``, for a backend that ``wants_dense_b``);
    - ``warm_up`` (batches of up to the largest of ``token_counts``) returns a count and changes no weight;
    - on a CUDA device: shrink and expand, and add_delta, captured in a CUDA graph and replayed with other adapter ids (and other
      inputs) give what they give eagerly.

    Raises AssertionError naming the broken rule.
    """
    factory = _resolve(backend)
    name = backend if isinstance(backend, str) else getattr(factory, "__name__", repr(factory))
    built = factory(len(_RANKS), _MAX_RANK, torch.device(device), dtype)
    _expect(isinstance(built, LoRABackend), f"{name} built a {type(built).__name__}, not a LoRABackend")
    generator = torch.Generator().manual_seed(seed)
    weights = _LoRAWeights(generator, torch.device(device), dtype)
    for num_tokens in token_counts:
        for layout in ("decode", "prefill"):
            ids = _adapter_ids(num_tokens, layout, generator).to(device)
            _check_batch(built, weights, ids, f"{name} ({dtype}, {num_tokens} tokens, {layout} ids)", generator)
    stacked = _StackedWeights(generator, torch.device(device), dtype)
    for num_tokens in token_counts if stacked_token_counts is None else stacked_token_counts:
        ids = _adapter_ids(num_tokens, "decode", generator).to(device)
        _check_stacked(built, stacked, ids, f"{name} ({dtype}, add_delta, {num_tokens} tokens)", generator)
    nobody = torch.full((max(token_counts),), NO_ADAPTER, dtype=torch.int64, device=device)
    _check_batch(built, weights, nobody, f"{name} ({dtype}, no token with an adapter)", generator)
    _check_warm_up(built, stacked, max(token_counts), f"{name} ({dtype}, warm_up)")
    if torch.device(device).type == "cuda":
        for num_tokens in token_counts:
            _check_graph_replay(built, weights, stacked, num_tokens,
                                f"{name} ({dtype}, CUDA graph of {num_tokens} tokens)", generator)


def _check_warm_up(backend: LoRABackend, stacked: "_StackedWeights", max_tokens: int, what: str) -> None:
    """``warm_up`` returns a count of batches and changes none of the layers' weights."""
    weights = stacked.weights
    before = [t.clone() for t in (weights.a, weights.b, weights.scalings, weights.ranks, weights.dense_b)]
    batches = backend.warm_up([weights, weights], max_tokens)
    _expect(isinstance(batches, int) and batches >= 0, f"{what}: returned {batches!r}, not a count of batches")
    after = (weights.a, weights.b, weights.scalings, weights.ranks, weights.dense_b)
    _expect(all(torch.equal(old, new) for old, new in zip(before, after)), f"{what}: changed the layers' weights")


class _LoRAWeights:
    """Random stacked adapters: ``a`` [slots, R, in], ``b`` [slots, out, R], zero past each slot's rank."""

    def __init__(self, generator: torch.Generator, device: torch.device, dtype: torch.dtype) -> None:
        slots = len(_RANKS)
        a = torch.randn(slots, _MAX_RANK, _IN_FEATURES, generator=generator) / _IN_FEATURES ** 0.5
        b = torch.randn(slots, _OUT_FEATURES, _MAX_RANK, generator=generator) / 4
        for slot, rank in enumerate(_RANKS):
            a[slot, rank:] = 0
            b[slot, :, rank:] = 0
        self.a, self.b = a.to(device, dtype), b.to(device, dtype)
        self.scalings = torch.tensor([2.0, 0.5, 1.25, 4.0], device=device)
        self.ranks = torch.tensor(_RANKS, dtype=torch.int32, device=device)
        self.dtype, self.device = dtype, device
        self.tolerance = 1e-4 if dtype == torch.float32 else 3e-2

    def random(self, *shape: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(self.device, self.dtype)


def _check_batch(backend: LoRABackend, weights: _LoRAWeights, ids: torch.Tensor, where: str,
                 generator: torch.Generator) -> None:
    num_tokens = ids.shape[0]
    x = weights.random(num_tokens, _IN_FEATURES, generator=generator)
    x_before, ids_before = x.clone(), ids.clone()
    h = backend.shrink(x, weights.a, ids, weights.scalings, weights.ranks)
    _expect(tuple(h.shape) == (num_tokens, _MAX_RANK) and h.dtype == weights.dtype,
            f"{where}: shrink returned {tuple(h.shape)} {h.dtype}, expected ({num_tokens}, {_MAX_RANK}) {weights.dtype}")
    _expect(torch.equal(x, x_before) and torch.equal(ids, ids_before), f"{where}: shrink modified its inputs")
    none = ids == NO_ADAPTER
    _expect(bool((h[none] == 0).all()), f"{where}: shrink's rows of tokens without an adapter are not zero")
    _expect_close(h, _reference_shrink(x, weights, ids), weights.tolerance, f"{where}: shrink")

    h_in = weights.random(num_tokens, _MAX_RANK, generator=generator)
    for wide_columns, start in ((_OUT_FEATURES, 0), (3 * _OUT_FEATURES + 5, _OUT_FEATURES + 3)):
        wide = weights.random(num_tokens, wide_columns, generator=generator)
        before = wide.clone()
        out = wide[:, start:start + _OUT_FEATURES]
        backend.expand(h_in, weights.b, ids, weights.ranks, out)
        kind = "a contiguous out" if wide_columns == _OUT_FEATURES else "a strided column slice"
        outside = torch.ones(wide_columns, dtype=torch.bool, device=wide.device)
        outside[start:start + _OUT_FEATURES] = False
        _expect(torch.equal(wide[:, outside], before[:, outside]),
                f"{where}: expand into {kind} wrote columns outside the slice")
        _expect(torch.equal(wide[none], before[none]),
                f"{where}: expand into {kind} changed rows of tokens without an adapter")
        expected = _reference_expand(h_in, weights, ids, before[:, start:start + _OUT_FEATURES])
        _expect_close(out, expected, weights.tolerance, f"{where}: expand into {kind}")


class _StackedWeights:
    """Three random projections stacked as a layer's StackedLoRA, output columns 2 to 82 of a layer of 86."""

    def __init__(self, generator: torch.Generator, device: torch.device, dtype: torch.dtype) -> None:
        slots, count = len(_RANKS), len(_STACKED_WIDTHS)
        a = torch.randn(slots, count * _MAX_RANK, _IN_FEATURES, generator=generator) / _IN_FEATURES ** 0.5
        b = torch.zeros(slots, 2 + sum(_STACKED_WIDTHS), _MAX_RANK)
        segments, start = [], 2
        for p, width in enumerate(_STACKED_WIDTHS):
            segments.append((start, start + width))
            b[:, start:start + width] = torch.randn(slots, width, _MAX_RANK, generator=generator) / 4
            for slot, rank in enumerate(_STACKED_RANKS[p]):
                a[slot, p * _MAX_RANK + rank:(p + 1) * _MAX_RANK] = 0
                b[slot, start:start + width, rank:] = 0
            start += width
        self.width = start + 4
        self.weights = StackedLoRA(a.to(device, dtype), b.to(device, dtype),
                                   (torch.rand(count, slots, generator=generator) * 2 + 0.25).to(device),
                                   torch.tensor(_STACKED_RANKS, dtype=torch.int32, device=device),
                                   tuple(segments)).with_dense_b()  # for a backend that wants_dense_b
        self.tolerance = 1e-4 if dtype == torch.float32 else 3e-2
        self.dtype, self.device = dtype, device

    def reference(self, x: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` plus every projection's delta, in float64, h rounded to x's dtype as the contract rounds it."""
        w, chosen, rank = self.weights, ids.clamp(min=0).cpu(), _MAX_RANK
        expected, keep = out.cpu().double(), (ids.cpu() != NO_ADAPTER).unsqueeze(-1)
        for p, (start, end) in enumerate(w.segments):
            a = w.a.cpu().double()[chosen, p * rank:(p + 1) * rank]
            h = torch.einsum("ti,tri->tr", x.cpu().double(), a) * w.scalings.cpu().double()[p, chosen][:, None]
            h = h.to(self.dtype).double()
            expected[:, start:end] += torch.einsum("tr,tor->to", h, w.b.cpu().double()[chosen, start:end]) * keep
        return expected


def _check_stacked(backend: LoRABackend, stacked: _StackedWeights, ids: torch.Tensor, where: str,
                   generator: torch.Generator) -> None:
    num_tokens = ids.shape[0]
    x = torch.randn(num_tokens, _IN_FEATURES, generator=generator).to(stacked.device, stacked.dtype)
    out = torch.randn(num_tokens, stacked.width, generator=generator).to(stacked.device, stacked.dtype)
    before, x_before = out.clone(), x.clone()
    backend.add_delta(x, stacked.weights, ids, out)
    _expect(torch.equal(x, x_before), f"{where}: modified x")
    none = ids == NO_ADAPTER
    _expect(torch.equal(out[none], before[none]), f"{where}: changed rows of tokens without an adapter")
    first, last = stacked.weights.segments[0][0], stacked.weights.segments[-1][1]
    _expect(torch.equal(out[:, :first], before[:, :first]) and torch.equal(out[:, last:], before[:, last:]),
            f"{where}: wrote columns outside the projections")
    _expect_close(out, stacked.reference(x, ids, before), stacked.tolerance, where)


def _check_graph_replay(backend: LoRABackend, weights: _LoRAWeights, stacked: _StackedWeights, num_tokens: int,
                        where: str, generator: torch.Generator) -> None:
    x = weights.random(num_tokens, _IN_FEATURES, generator=generator)
    ids = _adapter_ids(num_tokens, "decode", generator).to(weights.device)
    out = torch.zeros(num_tokens, _OUT_FEATURES + stacked.width, dtype=weights.dtype, device=weights.device)

    def step() -> None:
        out.zero_()
        backend.expand(backend.shrink(x, weights.a, ids, weights.scalings, weights.ranks), weights.b, ids,
                       weights.ranks, out[:, :_OUT_FEATURES])
        backend.add_delta(x, stacked.weights, ids, out[:, _OUT_FEATURES:])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for layout in ("prefill", "decode"):
        ids.copy_(_adapter_ids(num_tokens, layout, generator))
        x.copy_(weights.random(num_tokens, _IN_FEATURES, generator=generator))
        graph.replay()
        replayed = out.clone()
        step()
        _expect(torch.equal(replayed, out), f"{where}: a replay with {layout} ids differs from the eager call")


def _adapter_ids(num_tokens: int, layout: str, generator: torch.Generator) -> torch.Tensor:
    """Every token its own random slot (or none), or runs of random lengths sharing one, as a prefill batch's
    requests; the last slot is never used."""
    if layout == "decode":
        return torch.randint(-1, len(_RANKS) - 1, (num_tokens,), generator=generator)
    ids: list[int] = []
    while len(ids) < num_tokens:
        run = int(torch.randint(1, 40, (1,), generator=generator))
        ids += [int(torch.randint(-1, len(_RANKS) - 1, (1,), generator=generator))] * run
    return torch.tensor(ids[:num_tokens], dtype=torch.int64)


def _reference_shrink(x: torch.Tensor, weights: _LoRAWeights, ids: torch.Tensor) -> torch.Tensor:
    slots = ids.clamp(min=0).cpu()
    a, scalings = weights.a.cpu().double()[slots], weights.scalings.cpu().double()[slots]
    h = torch.einsum("ti,tri->tr", x.cpu().double(), a) * scalings[:, None]
    return h * (ids.cpu() != NO_ADAPTER).unsqueeze(-1)


def _reference_expand(h: torch.Tensor, weights: _LoRAWeights, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    b = weights.b.cpu().double()[ids.clamp(min=0).cpu()]
    delta = torch.einsum("tr,tor->to", h.cpu().double(), b) * (ids.cpu() != NO_ADAPTER).unsqueeze(-1)
    return out.cpu().double() + delta


def _expect_close(got: torch.Tensor, expected: torch.Tensor, tolerance: float, where: str) -> None:
    error = (got.cpu().double() - expected).abs()
    allowed = tolerance * (1 + expected.abs())
    worst = int((error - allowed).flatten().argmax()) if error.numel() else 0
    _expect(bool((error <= allowed).all()),
            f"{where}: differs from the reference arithmetic by {error.max().item():.3g} at element {worst} "
            f"(allowed {tolerance:g} x (1 + |expected|))")


def _resolve(backend: str | LoRABackendFactory) -> LoRABackendFactory:
    if not isinstance(backend, str):
        return backend
    from treadle.core.registry import build_registry

    return build_registry().get("lora_backends", backend)


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
