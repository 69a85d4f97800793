"""The attention conformance kit's world: a paged KV cache of random K/V, batches over it, the torch_native
reference, and the comparisons (see :mod:`treadle.testing.attention`).

Every slot no request owns holds NaN, so a backend reading a wrong slot poisons its output. The reference
computes in float32 from the same (rounded) values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from treadle.core.execution.attention import RadixAttention
from treadle.core.execution.attention_context import AttentionContext
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.memory.pools import FP8_KV_DTYPES, KVCache, ReqToTokenPool
from treadle.core.speculative.tree import TreeLayout

TOLERANCES = {  # (atol, rtol) against the float32 reference
    torch.float32: (1e-3, 1e-3),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 1e-2),
}
LAYER_ID = 1  # not layer 0, so a backend reading the wrong layer's buffers fails


@dataclass(frozen=True)
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class World:
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the backend's cache; the reference's is float32
    kv_scales: tuple[float, float]  # LAYER_ID's (k_scale, v_scale) in an FP8 cache
    shape: Shape
    page_size: int
    window: int | None
    pool: ReqToTokenPool
    pristine: KVCache  # K/V (model dtype) for every position of every request; NaN in unowned slots
    rows: list[int]  # each request's row in req_to_token
    slots: list[torch.Tensor]  # each request's slots for positions [0, max_len), device int64
    max_lens: list[int]

    @classmethod
    def build(cls, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, kv_scales: tuple[float, float],
              shape: Shape, page_size: int, window: int | None, batch_size: int, max_seq_len: int,
              generator: torch.Generator) -> "World":
        max_lens = [int(n) for n in torch.randint(2, max_seq_len + 1, (batch_size,), generator=generator)]
        max_lens[0] = max_seq_len
        pages_per_req = [math.ceil(n / page_size) for n in max_lens]
        num_pages = sum(pages_per_req) + 3
        cache = KVCache(num_pages * page_size, page_size, 2, shape.num_kv_heads, shape.head_dim, dtype, device)
        for buffer in cache.k_buffers + cache.v_buffers:
            buffer.fill_(float("nan"))
        # Row 0 stays unused: CUDA-graph padding rows point at it.
        pool = ReqToTokenPool(batch_size + 3, max_seq_len + page_size, device)
        rows = (torch.randperm(batch_size + 2, generator=generator)[:batch_size] + 1).tolist()
        page_ids = torch.randperm(num_pages, generator=generator) + 1  # page 0 is padding
        slots: list[torch.Tensor] = []
        world = cls(device, dtype, kv_dtype, kv_scales, shape, page_size, window, pool, cache, rows, slots, max_lens)
        first = 0
        for row, n, count in zip(rows, max_lens, pages_per_req):
            positions = torch.arange(n)
            request_slots = page_ids[first + positions // page_size] * page_size + positions % page_size
            first += count
            pool.req_to_token[row, :n] = request_slots.to(device=device, dtype=torch.int32)
            request_slots = request_slots.to(device)
            for layer in range(cache.num_layers):
                cache.k_buffers[layer][request_slots] = world.kv_values(n, "k", layer, generator)
                cache.v_buffers[layer][request_slots] = world.kv_values(n, "v", layer, generator)
            slots.append(request_slots)
        return world

    @property
    def fp8(self) -> bool:
        return self.kv_dtype in FP8_KV_DTYPES

    def scales(self, layer: int) -> tuple[float, float]:
        """A layer's (k_scale, v_scale) in an FP8 cache: other layers get twice LAYER_ID's, so a backend
        applying the wrong layer's scales fails."""
        k_scale, v_scale = self.kv_scales
        return (k_scale, v_scale) if layer == LAYER_ID else (2 * k_scale, 2 * v_scale)

    def kv_values(self, tokens: int, name: str, layer: int, generator: torch.Generator) -> torch.Tensor:
        """``[tokens, num_kv_heads, head_dim]`` K or V values for ``layer`` in the model dtype: random normal,
        or, for an FP8 cache, multiples of 1/8 in [-2, 2] (exact in e4m3) times the layer's scale."""
        shape = (tokens, self.shape.num_kv_heads, self.shape.head_dim)
        if not self.fp8:
            return randn(shape, generator, self.device, self.dtype)
        scale = self.scales(layer)[0 if name == "k" else 1]
        values = torch.randint(-16, 17, shape, generator=generator).float() / 8 * scale
        return values.to(device=self.device, dtype=self.dtype)

    def fresh_cache(self, dtype: torch.dtype | None = None) -> KVCache:
        """A copy of the pristine cache in ``dtype`` (default: the backend's ``kv_dtype``; float32 for the
        reference); an FP8 copy stores each value divided by its layer's scale."""
        src = self.pristine
        cache = KVCache(src.size, src.page_size, src.num_layers, src.num_kv_heads, src.head_dim,
                        dtype or self.kv_dtype, src.device)
        if cache.is_fp8:
            for layer in range(cache.num_layers):
                cache.k_scales[layer], cache.v_scales[layer] = self.scales(layer)
        self.restore(cache)
        return cache

    def restore(self, cache: KVCache) -> None:
        """Overwrite ``cache``'s K/V in place with the pristine values (quantized for an FP8 cache)."""
        src = self.pristine
        for layer in range(cache.num_layers):
            for name, scales in (("k", cache.k_scales), ("v", cache.v_scales)):
                values = getattr(src, f"{name}_buffers")[layer]
                if cache.is_fp8:
                    values = values.float() / scales[layer]  # exact: the values were made for these scales
                getattr(cache, f"{name}_buffers")[layer].copy_(values)

    def context(self, cache: KVCache) -> AttentionContext:
        """What a backend is built from (the model dtype is the cache's, but for an FP8 cache)."""
        return AttentionContext(
            device=self.device, dtype=self.dtype if cache.is_fp8 else cache.dtype, kv_dtype=cache.dtype,
            num_layers=cache.num_layers, num_heads=self.shape.num_heads, num_kv_heads=self.shape.num_kv_heads,
            head_dim=self.shape.head_dim, page_size=self.page_size, context_len=self.pool.max_context_len - self.page_size,
            req_to_token_pool=self.pool, kv_cache=cache, sliding_window=self.window,
            layer_sliding_windows=(self.window,) * cache.num_layers,
        )

    def layer(self) -> RadixAttention:
        s = self.shape
        return RadixAttention(s.num_heads, s.head_dim, s.head_dim**-0.5, s.num_kv_heads, LAYER_ID,
                              sliding_window_size=self.window)


@dataclass
class Step:
    """One batch's inputs: the ForwardBatch fields and this step's q, k, v."""

    mode: ForwardMode
    rows: torch.Tensor
    seq_lens: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    tree_mask: torch.Tensor | None = None  # a TARGET_VERIFY step over draft trees: [bs, t, t] (ForwardBatch's)

    def forward_batch(self, pool: ReqToTokenPool, cache: KVCache, backend: Any) -> ForwardBatch:
        device = cache.device
        extend = self.mode.is_extend()
        extend_lens = torch.tensor(self.extend_lens, dtype=torch.int64)
        starts = torch.cumsum(extend_lens, 0) - extend_lens
        seq_lens = torch.tensor(self.seq_lens, dtype=torch.int64)
        return ForwardBatch(
            forward_mode=self.mode,
            batch_size=len(self.seq_lens),
            input_ids=torch.zeros(self.q.shape[0], dtype=torch.int64, device=device),
            positions=self.positions,
            req_pool_indices=self.rows,
            seq_lens=seq_lens.to(device),
            seq_lens_cpu=seq_lens,
            out_cache_loc=self.out_cache_loc,
            seq_lens_sum=int(seq_lens.sum()),
            logits_indices=(starts + extend_lens - 1).to(device),
            req_to_token_pool=pool,
            kv_cache=cache,
            attn_backend=backend,
            extend_seq_lens=extend_lens.to(device) if extend else None,
            extend_prefix_lens=torch.tensor(self.prefix_lens, dtype=torch.int64, device=device) if extend else None,
            extend_start_loc=starts.to(device) if extend else None,
            extend_seq_lens_cpu=list(self.extend_lens) if extend else None,
            extend_prefix_lens_cpu=list(self.prefix_lens) if extend else None,
            tokens_per_req=self.extend_lens[0] if self.mode.is_verify() else 1,
            tree_mask=self.tree_mask,
        )


def make_step(world: World, mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int],
               generator: torch.Generator) -> Step:
    device, dtype, s = world.device, world.dtype, world.shape
    out_cache_loc = torch.cat([slots[p:p + e] for slots, p, e in zip(world.slots, prefix_lens, extend_lens)])
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)]).to(device)
    tokens = sum(extend_lens)
    return Step(
        mode=mode,
        rows=torch.tensor(world.rows, dtype=torch.int64, device=device),
        seq_lens=[p + e for p, e in zip(prefix_lens, extend_lens)],
        prefix_lens=list(prefix_lens),
        extend_lens=list(extend_lens),
        out_cache_loc=out_cache_loc,
        positions=positions,
        q=randn((tokens, s.num_heads * s.head_dim), generator, device, dtype),
        k=world.kv_values(tokens, "k", LAYER_ID, generator).view(tokens, -1),
        v=world.kv_values(tokens, "v", LAYER_ID, generator).view(tokens, -1),
    )


def make_tree_step(world: World, prefix_lens: list[int], tokens: int, generator: torch.Generator) -> Step:
    """A TARGET_VERIFY step whose ``tokens`` new tokens per request form a random draft tree: each at the position
    of its depth past the prefix, attending to the prefix and its ancestors (``tree_mask``)."""
    parents = torch.tensor([[int(torch.randint(-1, j, (1,), generator=generator)) for j in range(tokens - 1)]
                            for _ in prefix_lens], dtype=torch.int64)
    layout = TreeLayout.by_squaring(parents)
    step = make_step(world, ForwardMode.TARGET_VERIFY, prefix_lens, [tokens] * len(prefix_lens), generator)
    step.positions = (torch.tensor(prefix_lens)[:, None] + layout.depth).flatten().to(world.device)
    step.tree_mask = layout.ancestors.to(world.device)
    return step


def extend_scenarios(max_lens: list[int], page_size: int,
                      generator: torch.Generator) -> list[tuple[str, list[int], list[int]]]:
    """(name, prefix_lens, extend_lens): no prefix; a page-aligned cached prefix; an unaligned one (a chunk)."""
    scenarios = [("no prefix", [0] * len(max_lens), list(max_lens))]
    aligned, unaligned = [], []
    for n in max_lens:
        pages = (n - 1) // page_size
        aligned.append(int(torch.randint(0, pages + 1, (1,), generator=generator)) * page_size)
        unaligned.append(int(torch.randint(0, n, (1,), generator=generator)))
    scenarios.append(("page-aligned cached prefix", aligned, [n - p for n, p in zip(max_lens, aligned)]))
    scenarios.append(("unaligned prefix", unaligned, [n - p for n, p in zip(max_lens, unaligned)]))
    return scenarios


# ------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------


def reference(world: World, step: Step) -> tuple[torch.Tensor, KVCache]:
    from treadle.core.registry import build_registry

    registry = build_registry(["treadle.plugins.attention.torch_native"], load_entry_points=False)
    cache = world.fresh_cache(torch.float32)
    backend = registry.get("attention", "torch_native")(world.context(cache))
    forward_batch = step.forward_batch(world.pool, cache, backend)
    backend.init_forward_metadata(forward_batch)
    out = backend.forward(step.q.float(), step.k.float(), step.v.float(), world.layer(), forward_batch)
    return out, cache


def build_backend(factory: Callable[[Any], Any], configure: Callable[[Any], None] | None,
                   world: World, cache: KVCache) -> Any:
    backend = factory(world.context(cache))
    if configure is not None:
        configure(backend)
    return backend


def assert_output(out: torch.Tensor, expected: torch.Tensor, q_shape: torch.Size,
                   tol: tuple[float, float], context: str) -> None:
    assert tuple(out.shape) == tuple(q_shape), (
        f"{context}: output shape {tuple(out.shape)}, expected q's shape {tuple(q_shape)}"
    )
    out = out.float()
    assert torch.isfinite(out).all(), (
        f"{context}: output has NaN/inf — the backend read a KV slot that no request owns, or a masked one"
    )
    atol, rtol = tol
    error = (out - expected).abs()
    bound = atol + rtol * expected.abs()
    if not bool((error <= bound).all()):
        worst = int((error - bound).flatten().argmax())
        raise AssertionError(
            f"{context}: output differs from torch_native by up to {error.max().item():.3g} "
            f"(atol={atol}, rtol={rtol}); worst at flat index {worst}: got {out.flatten()[worst].item():.5g}, "
            f"expected {expected.flatten()[worst].item():.5g}"
        )


def assert_kv_written(cache: KVCache, ref_cache: KVCache, out_cache_loc: torch.Tensor, context: str) -> None:
    for name in ("k", "v"):
        got = getattr(cache, f"{name}_buffers")[LAYER_ID][out_cache_loc].float()
        if cache.is_fp8:
            got = got * getattr(cache, f"{name}_scales")[LAYER_ID]
        want = getattr(ref_cache, f"{name}_buffers")[LAYER_ID][out_cache_loc]
        assert torch.equal(got, want), f"{context}: the backend did not write this step's {name.upper()} at out_cache_loc"


def randn(shape: tuple[int, ...], generator: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
