"""Conformance check for attention backends: compare a backend with ``torch_native`` on random batches.

    from treadle.testing import check_attention_backend

    def test_my_backend_conforms():
        check_attention_backend(MyAttnBackend, "cuda", torch.bfloat16)

Each scenario builds a KV cache whose requests sit on shuffled pages (every
slot no request owns holds NaN, so reading a wrong slot poisons the output),
runs the backend and the reference on identical copies, and compares the
attention output and the K/V the backend wrote. Scenarios: extend with a
cached prefix (aligned and unaligned to pages, and no prefix), decode (and,
for a backend that ``applies_rotary`` to decode batches, decode with q and k
passed before the rotary embedding), each with GQA, with and without a
sliding window, for every page size asked for;
on CUDA, for a backend with ``supports_cuda_graph``, decode captured in a CUDA
graph at a padded batch size and replayed twice with new lengths. The
reference computes in float32 from the same (rounded) values.

With an FP8 ``kv_dtype`` the backend reads an FP8 cache with per-layer scales
while torch_native (which does not read FP8) reads an unquantized cache holding
the same values: every K/V value is a multiple of 1/8 in [-2, 2] times the layer's
scale, exact in the model dtype and, divided by the scale, in FP8.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from treadle.core.execution.attention import RadixAttention
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.memory.pools import FP8_KV_DTYPES, KVCache, ReqToTokenPool

_TOLERANCES = {  # (atol, rtol) against the float32 reference
    torch.float32: (1e-3, 1e-3),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 1e-2),
}
LAYER_ID = 1  # not layer 0, so a backend reading the wrong layer's buffers fails


def check_attention_backend(
    factory: Callable[[Any], Any],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    page_sizes: Sequence[int] = (1, 16),
    sliding_window: int = 24,
    max_seq_len: int = 80,
    batch_size: int = 5,
    check_cuda_graph: bool | None = None,
    configure: Callable[[Any], None] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    seed: int = 0,
    kv_dtype: torch.dtype | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Raise AssertionError (naming the scenario) unless ``factory(model_runner)`` attends like torch_native.

    ``max_seq_len`` bounds the requests' lengths (use thousands on a GPU);
    ``configure(backend)`` may adjust a freshly built backend (e.g. small block
    sizes so short requests cross block boundaries); ``check_cuda_graph``
    defaults to "on CUDA, when the backend says it supports CUDA graphs".

    ``kv_dtype`` is the backend's KV cache dtype (None: ``dtype``); an FP8 dtype
    (``torch.float8_e4m3fn``) gives the backend an FP8 cache whose attended layer
    has scales ``kv_scales`` = (k_scale, v_scale) (the other layer twice those),
    and checks its output and the K/V it writes (dequantized) exactly as over an
    unquantized cache. Scales must be powers of two so every value stays exact.
    """
    device = torch.device(device)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if kv_dtype != dtype and kv_dtype not in FP8_KV_DTYPES:
        raise ValueError(f"kv_dtype must be None, the model dtype or one of {FP8_KV_DTYPES}, not {kv_dtype}")
    if kv_dtype in FP8_KV_DTYPES and any(not (s > 0 and math.frexp(s)[0] == 0.5) for s in kv_scales):
        raise ValueError(f"kv_scales must be powers of two (so the kit's K/V values stay exact), not {kv_scales}")
    default_atol, default_rtol = _TOLERANCES.get(dtype, (2e-2, 1e-2))
    tol = (default_atol if atol is None else atol, default_rtol if rtol is None else rtol)
    shape = _Shape(num_heads, num_kv_heads, head_dim)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for page_size in page_sizes:
        for window in (None, sliding_window):
            world = _World.build(device, dtype, kv_dtype, tuple(kv_scales), shape, page_size, window, batch_size,
                                 max_seq_len, generator)
            context = f"page_size={page_size}, sliding_window={window}, dtype={dtype}"
            if kv_dtype != dtype:
                context += f", kv_dtype={kv_dtype}, kv_scales={tuple(kv_scales)}"
            for name, prefix_lens, extend_lens in _extend_scenarios(world.max_lens, page_size, generator):
                _check_step(factory, configure, world, ForwardMode.EXTEND, prefix_lens, extend_lens, tol,
                            f"extend ({name}) with {context}", generator)
            decode_lens = [int(torch.randint(1, n + 1, (1,), generator=generator)) for n in world.max_lens]
            decode_lens[0] = world.max_lens[0]
            _check_step(factory, configure, world, ForwardMode.DECODE, [n - 1 for n in decode_lens],
                        [1] * len(decode_lens), tol, f"decode with {context}", generator)
            if not world.fp8:  # rotated K/V are no longer exact in FP8, which the comparison relies on
                _check_rotary_decode(factory, configure, world, decode_lens, tol,
                                     f"decode, rotary embedding applied by the backend, with {context}", generator)
            graphs = check_cuda_graph
            if graphs is None:
                graphs = device.type == "cuda" and bool(getattr(factory, "supports_cuda_graph", False))
            if graphs:
                _check_cuda_graph_decode(factory, configure, world, tol, f"CUDA-graph decode with {context}",
                                         generator)


# ------------------------------------------------------------------------------------------------
# The world: a paged KV cache holding random K/V for every request position
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class _World:
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the backend's cache; the reference's is float32
    kv_scales: tuple[float, float]  # LAYER_ID's (k_scale, v_scale) in an FP8 cache
    shape: _Shape
    page_size: int
    window: int | None
    pool: ReqToTokenPool
    pristine: KVCache  # K/V (model dtype) for every position of every request; NaN in unowned slots
    rows: list[int]  # each request's row in req_to_token
    slots: list[torch.Tensor]  # each request's slots for positions [0, max_len), device int64
    max_lens: list[int]

    @classmethod
    def build(cls, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, kv_scales: tuple[float, float],
              shape: _Shape, page_size: int, window: int | None, batch_size: int, max_seq_len: int,
              generator: torch.Generator) -> "_World":
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
            return _randn(shape, generator, self.device, self.dtype)
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

    def runner(self, cache: KVCache) -> SimpleNamespace:
        """The model-runner attributes a backend may read."""
        return SimpleNamespace(
            device=self.device, dtype=self.dtype if cache.is_fp8 else cache.dtype, num_heads=self.shape.num_heads,
            num_kv_heads=self.shape.num_kv_heads, head_dim=self.shape.head_dim, page_size=self.page_size,
            req_to_token_pool=self.pool, kv_cache=cache, sliding_window=self.window,
            context_len=self.pool.max_context_len - self.page_size,
        )

    def layer(self) -> RadixAttention:
        s = self.shape
        return RadixAttention(s.num_heads, s.head_dim, s.head_dim**-0.5, s.num_kv_heads, LAYER_ID,
                              sliding_window_size=self.window)


@dataclass
class _Step:
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
        )


def _make_step(world: _World, mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int],
               generator: torch.Generator) -> _Step:
    device, dtype, s = world.device, world.dtype, world.shape
    out_cache_loc = torch.cat([slots[p:p + e] for slots, p, e in zip(world.slots, prefix_lens, extend_lens)])
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)]).to(device)
    tokens = sum(extend_lens)
    return _Step(
        mode=mode,
        rows=torch.tensor(world.rows, dtype=torch.int64, device=device),
        seq_lens=[p + e for p, e in zip(prefix_lens, extend_lens)],
        prefix_lens=list(prefix_lens),
        extend_lens=list(extend_lens),
        out_cache_loc=out_cache_loc,
        positions=positions,
        q=_randn((tokens, s.num_heads * s.head_dim), generator, device, dtype),
        k=world.kv_values(tokens, "k", LAYER_ID, generator).view(tokens, -1),
        v=world.kv_values(tokens, "v", LAYER_ID, generator).view(tokens, -1),
    )


def _extend_scenarios(max_lens: list[int], page_size: int,
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


def _reference(world: _World, step: _Step) -> tuple[torch.Tensor, KVCache]:
    from treadle.core.registry import build_registry

    registry = build_registry(["treadle.plugins.attention.torch_native"], load_entry_points=False)
    cache = world.fresh_cache(torch.float32)
    backend = registry.get("attention", "torch_native")(world.runner(cache))
    forward_batch = step.forward_batch(world.pool, cache, backend)
    backend.init_forward_metadata(forward_batch)
    out = backend.forward(step.q.float(), step.k.float(), step.v.float(), world.layer(), forward_batch)
    return out, cache


def _build_backend(factory: Callable[[Any], Any], configure: Callable[[Any], None] | None,
                   world: _World, cache: KVCache) -> Any:
    backend = factory(world.runner(cache))
    if configure is not None:
        configure(backend)
    return backend


def _check_step(factory, configure, world: _World, mode: ForwardMode, prefix_lens: list[int],
                extend_lens: list[int], tol: tuple[float, float], context: str, generator: torch.Generator) -> None:
    step = _make_step(world, mode, prefix_lens, extend_lens, generator)
    expected, ref_cache = _reference(world, step)
    cache = world.fresh_cache()
    backend = _build_backend(factory, configure, world, cache)
    forward_batch = step.forward_batch(world.pool, cache, backend)
    backend.init_forward_metadata(forward_batch)
    out = backend.forward(step.q, step.k, step.v, world.layer(), forward_batch)
    _assert_output(out, expected, step.q.shape, tol, context)
    _assert_kv_written(cache, ref_cache, step.out_cache_loc, context)


def _check_rotary_decode(factory, configure, world: _World, seq_lens: list[int], tol: tuple[float, float],
                         context: str, generator: torch.Generator) -> None:
    """Where the backend applies the rotary embedding itself (``applies_rotary``), q and k passed before it with
    ``rotary=(cos, sin)`` attend like q and k rotated first (HF's ``rotate_half`` form, in the model dtype), and
    the K it writes is the rotated one."""
    step = _make_step(world, ForwardMode.DECODE, [n - 1 for n in seq_lens], [1] * len(seq_lens), generator)
    cache = world.fresh_cache()
    backend = _build_backend(factory, configure, world, cache)
    forward_batch = step.forward_batch(world.pool, cache, backend)
    backend.init_forward_metadata(forward_batch)
    if not backend.applies_rotary(forward_batch):
        return
    head_dim = world.shape.head_dim
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = step.positions.float().cpu()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = (t.to(device=world.device, dtype=world.dtype) for t in (angles.cos(), angles.sin()))

    def rotate(x: torch.Tensor) -> torch.Tensor:
        heads = x.view(x.shape[0], -1, head_dim)
        half = head_dim // 2
        rotated_half = torch.cat((-heads[..., half:], heads[..., :half]), dim=-1)
        return (heads * cos + rotated_half * sin).flatten(1)

    rotated = dataclasses.replace(step, q=rotate(step.q), k=rotate(step.k))
    expected, ref_cache = _reference(world, rotated)
    out = world.layer()(step.q, step.k, step.v, forward_batch, rotary=(cos, sin))
    _assert_output(out, expected, step.q.shape, tol, context)
    for name in ("k", "v"):
        got = getattr(cache, f"{name}_buffers")[LAYER_ID][step.out_cache_loc].float().flatten(1)
        want = getattr(ref_cache, f"{name}_buffers")[LAYER_ID][step.out_cache_loc].flatten(1)
        _assert_output(got, want, want.shape, tol, f"{context}: the {name.upper()} written at out_cache_loc")


def _check_cuda_graph_decode(factory, configure, world: _World, tol: tuple[float, float], context: str,
                             generator: torch.Generator) -> None:
    """Capture decode at a padded batch size, then replay it twice with new lengths and new inputs."""
    device, s = world.device, world.shape
    real_bs = len(world.rows)
    graph_bs = real_bs + 3
    cache = world.fresh_cache()
    backend = _build_backend(factory, configure, world, cache)
    backend.init_cuda_graph_state(graph_bs, graph_bs)
    fill = int(backend.get_cuda_graph_seq_len_fill_value())
    static = SimpleNamespace(
        rows=torch.zeros(graph_bs, dtype=torch.int64, device=device),
        seq_lens=torch.full((graph_bs,), fill, dtype=torch.int64, device=device),
        seq_lens_cpu=torch.full((graph_bs,), fill, dtype=torch.int64),
        out_cache_loc=torch.zeros(graph_bs, dtype=torch.int64, device=device),
        q=torch.zeros(graph_bs, s.num_heads * s.head_dim, dtype=world.dtype, device=device),
        k=torch.zeros(graph_bs, s.num_kv_heads * s.head_dim, dtype=world.dtype, device=device),
        v=torch.zeros(graph_bs, s.num_kv_heads * s.head_dim, dtype=world.dtype, device=device),
    )
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=graph_bs,
        input_ids=torch.zeros(graph_bs, dtype=torch.int64, device=device),
        positions=torch.zeros(graph_bs, dtype=torch.int64, device=device),
        req_pool_indices=static.rows, seq_lens=static.seq_lens, seq_lens_cpu=static.seq_lens_cpu,
        out_cache_loc=static.out_cache_loc, seq_lens_sum=graph_bs * fill,
        logits_indices=torch.arange(graph_bs, device=device),
        req_to_token_pool=world.pool, kv_cache=cache, attn_backend=backend,
    )
    layer = world.layer()
    backend.init_forward_metadata_capture_cuda_graph(graph_bs, graph_bs, static.rows, static.seq_lens,
                                                     ForwardMode.DECODE)
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        backend.forward(static.q, static.k, static.v, layer, forward_batch)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_out = backend.forward(static.q, static.k, static.v, layer, forward_batch)

    for replay in range(2):
        lens = [int(torch.randint(1, n + 1, (1,), generator=generator)) for n in world.max_lens]
        lens[replay % real_bs] = world.max_lens[replay % real_bs]
        step = _make_step(world, ForwardMode.DECODE, [n - 1 for n in lens], [1] * real_bs, generator)
        expected, ref_cache = _reference(world, step)
        world.restore(cache)  # in place: the graph captured these buffers
        static.rows.zero_()
        static.rows[:real_bs].copy_(step.rows)
        static.seq_lens.fill_(fill)
        static.seq_lens[:real_bs].copy_(torch.tensor(lens, device=device))
        static.seq_lens_cpu.fill_(fill)
        static.seq_lens_cpu[:real_bs].copy_(torch.tensor(lens))
        static.out_cache_loc.zero_()
        static.out_cache_loc[:real_bs].copy_(step.out_cache_loc)
        for name in ("q", "k", "v"):
            getattr(static, name)[:real_bs].copy_(getattr(step, name))
        backend.init_forward_metadata_replay_cuda_graph(
            graph_bs, static.rows, static.seq_lens, int(static.seq_lens_cpu.sum()), ForwardMode.DECODE,
            seq_lens_cpu=static.seq_lens_cpu,
        )
        graph.replay()
        torch.cuda.synchronize(device)
        where = f"{context} (replay {replay + 1}, batch {real_bs} padded to {graph_bs})"
        _assert_output(static_out[:real_bs], expected, step.q.shape, tol, where)
        _assert_kv_written(cache, ref_cache, step.out_cache_loc, where)


def _assert_output(out: torch.Tensor, expected: torch.Tensor, q_shape: torch.Size,
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


def _assert_kv_written(cache: KVCache, ref_cache: KVCache, out_cache_loc: torch.Tensor, context: str) -> None:
    for name in ("k", "v"):
        got = getattr(cache, f"{name}_buffers")[LAYER_ID][out_cache_loc].float()
        if cache.is_fp8:
            got = got * getattr(cache, f"{name}_scales")[LAYER_ID]
        want = getattr(ref_cache, f"{name}_buffers")[LAYER_ID][out_cache_loc]
        assert torch.equal(got, want), f"{context}: the backend did not write this step's {name.upper()} at out_cache_loc"


def _randn(shape: tuple[int, ...], generator: torch.Generator, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
