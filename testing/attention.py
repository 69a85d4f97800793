"""Conformance check for attention backends: compare a backend with ``torch_native`` on random batches.

    from treadle.testing import check_attention_backend

    def test_my_backend_conforms():
        check_attention_backend(MyAttnBackend, "cuda", torch.bfloat16)

The backend is built as ``factory(context)`` from an
:class:`~treadle.core.execution.attention_context.AttentionContext`. Each scenario builds a KV cache
whose requests sit on shuffled pages (every slot no request owns holds NaN, so reading a wrong slot
poisons the output), runs the backend and the reference on identical copies, and compares the
attention output and the K/V the backend wrote. Scenarios: extend with a cached prefix (aligned and
unaligned to pages, and no prefix), decode (with the host's lengths as upper bounds where the backend's
``decodes_by_device_lengths`` says it runs decode steps from the device's; for a backend that
``applies_rotary`` to decode batches, decode with q and k passed before the rotary embedding), TARGET_VERIFY steps (every request
the same 2 or more new tokens after its prefix: an extend-shaped step; where the backend's ``verifies_by_decode``
says it runs one from the device's lengths, again with the host's upper bounds of an overlapped verify step; for
a backend with ``supports_tree_mask`` also over random draft trees, ``ForwardBatch.tree_mask``), each with GQA,
with and without a sliding window, for every page size asked for; on CUDA, for a backend with
``supports_cuda_graph``, decode captured in a CUDA graph at a padded batch size and replayed twice with new
lengths, and the same for TARGET_VERIFY with ``supports_verify_cuda_graph``. The reference computes in float32
from the same (rounded) values.

With an FP8 ``kv_dtype`` the backend reads an FP8 cache with per-layer scales
while torch_native (which does not read FP8) reads an unquantized cache holding
the same values: every K/V value is a multiple of 1/8 in [-2, 2] times the layer's
scale, exact in the model dtype and, divided by the scale, in FP8.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import torch

from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.memory.pools import FP8_KV_DTYPES
from treadle.testing.attention_graphs import check_graph_replay
from treadle.testing.attention_world import (
    LAYER_ID,
    TOLERANCES,
    Shape,
    World,
    assert_kv_written,
    assert_output,
    build_backend,
    extend_scenarios,
    make_step,
    make_tree_step,
    reference,
)


HOST_SLACK = 3  # drafts of the previous step the host counts as kept, past each request's true length


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
    check_verify: bool = True,
) -> None:
    """Raise AssertionError (naming the scenario) unless ``factory(context)`` attends like torch_native.

    ``max_seq_len`` bounds the requests' lengths (use thousands on a GPU);
    ``configure(backend)`` may adjust a freshly built backend (e.g. small block
    sizes so short requests cross block boundaries); ``check_cuda_graph``
    defaults to "on CUDA, when the backend says it supports CUDA graphs".

    ``kv_dtype`` is the backend's KV cache dtype (None: ``dtype``); an FP8 dtype
    (``torch.float8_e4m3fn``) gives the backend an FP8 cache whose attended layer
    has scales ``kv_scales`` = (k_scale, v_scale) (the other layer twice those),
    and checks its output and the K/V it writes (dequantized) exactly as over an
    unquantized cache. Scales must be powers of two so every value stays exact.

    ``check_verify=False`` skips the TARGET_VERIFY scenarios (a backend that runs every extend-shaped batch
    through ``forward_extend`` passes them; one that tells modes apart must treat TARGET_VERIFY as an extend).
    """
    device = torch.device(device)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if kv_dtype != dtype and kv_dtype not in FP8_KV_DTYPES:
        raise ValueError(f"kv_dtype must be None, the model dtype or one of {FP8_KV_DTYPES}, not {kv_dtype}")
    if kv_dtype in FP8_KV_DTYPES and any(not (s > 0 and math.frexp(s)[0] == 0.5) for s in kv_scales):
        raise ValueError(f"kv_scales must be powers of two (so the kit's K/V values stay exact), not {kv_scales}")
    default_atol, default_rtol = TOLERANCES.get(dtype, (2e-2, 1e-2))
    tol = (default_atol if atol is None else atol, default_rtol if rtol is None else rtol)
    shape = Shape(num_heads, num_kv_heads, head_dim)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for page_size in page_sizes:
        for window in (None, sliding_window):
            world = World.build(device, dtype, kv_dtype, tuple(kv_scales), shape, page_size, window, batch_size,
                                 max_seq_len, generator)
            context = f"page_size={page_size}, sliding_window={window}, dtype={dtype}"
            if kv_dtype != dtype:
                context += f", kv_dtype={kv_dtype}, kv_scales={tuple(kv_scales)}"
            for name, prefix_lens, extend_lens in extend_scenarios(world.max_lens, page_size, generator):
                _check_step(factory, configure, world, ForwardMode.EXTEND, prefix_lens, extend_lens, tol,
                            f"extend ({name}) with {context}", generator)
            decode_lens = [int(torch.randint(1, n + 1, (1,), generator=generator)) for n in world.max_lens]
            decode_lens[0] = world.max_lens[0]
            decode = make_step(world, ForwardMode.DECODE, [n - 1 for n in decode_lens], [1] * len(decode_lens),
                               generator)
            # From the device's lengths, the host's being upper bounds (which the exact ones are too), where the
            # backend says it decodes so (eagle3's drafting for an overlapped verify step relies on it).
            if not _check_prepared_step(factory, configure, world, decode, tol, f"decode from the device's lengths "
                                        f"(decodes_by_device_lengths; the host's upper bounds) with {context}",
                                        host_upper_bounds=True):
                _check_prepared_step(factory, configure, world, decode, tol, f"decode with {context}")
            if not world.fp8:  # rotated K/V are no longer exact in FP8, which the comparison relies on
                _check_rotary_decode(factory, configure, world, decode_lens, tol,
                                     f"decode, rotary embedding applied by the backend, with {context}", generator)
            graphs = check_cuda_graph
            if graphs is None:
                graphs = device.type == "cuda" and bool(getattr(factory, "supports_cuda_graph", False))
            if graphs:
                check_graph_replay(factory, configure, world, tol, f"CUDA-graph decode with {context}", generator)
            if check_verify:
                _check_verify_steps(factory, configure, world, tol, context, generator, graphs)


def _check_verify_steps(factory, configure, world: World, tol: tuple[float, float], context: str,
                        generator: torch.Generator, graphs: bool) -> None:
    """TARGET_VERIFY steps of 2 and k + 1 tokens (2, the smallest, from the device's lengths too:
    ``verifies_by_decode``), over draft trees too (``supports_tree_mask``), and through CUDA graphs
    (``supports_verify_cuda_graph``, when ``graphs``)."""
    verify_tokens = min(4, min(world.max_lens))  # k + 1: every request must hold that many tokens
    trees = bool(getattr(factory, "supports_tree_mask", False))
    for tokens in sorted({2, verify_tokens}):
        _check_verify(factory, configure, world, tokens, tol, context, generator,
                      from_device_lengths=tokens == 2)
    if trees:
        _check_tree_verify(factory, configure, world, verify_tokens, tol, context, generator)
    if not (graphs and getattr(factory, "supports_verify_cuda_graph", False)):
        return
    check_graph_replay(factory, configure, world, tol,
                       f"CUDA-graph TARGET_VERIFY of {verify_tokens} tokens per request with {context}",
                       generator, tokens_per_req=verify_tokens)
    if trees:
        check_graph_replay(factory, configure, world, tol, f"CUDA-graph TARGET_VERIFY over draft trees of "
                           f"{verify_tokens} tokens per request with {context}", generator,
                           tokens_per_req=verify_tokens, trees=True)


def _check_step(factory, configure, world: World, mode: ForwardMode, prefix_lens: list[int],
                extend_lens: list[int], tol: tuple[float, float], context: str, generator: torch.Generator) -> None:
    _check_prepared_step(factory, configure, world, make_step(world, mode, prefix_lens, extend_lens, generator), tol,
                         context)


def _check_prepared_step(factory, configure, world: World, step, tol: tuple[float, float], context: str,
                         host_upper_bounds: bool = False) -> bool:
    """``host_upper_bounds``: only where the backend runs the step from the device's lengths (a decode step:
    ``decodes_by_device_lengths``; a verify step: ``verifies_by_decode``), with the host's as an overlapped verify
    step has them (:func:`_with_host_upper_bounds`). Returns whether the step ran."""
    cache = world.fresh_cache()
    backend = build_backend(factory, configure, world, cache)
    forward_batch = step.forward_batch(world.pool, cache, backend)
    if host_upper_bounds:
        if step.mode.is_decode():
            reads_device = backend.decodes_by_device_lengths()
        else:
            reads_device = backend.verifies_by_decode(step.mode, forward_batch.num_tokens)
        if not reads_device:
            return False
        forward_batch = _with_host_upper_bounds(forward_batch, world)
    expected, ref_cache = reference(world, step)
    backend.init_forward_metadata(forward_batch)
    out = backend.forward(step.q, step.k, step.v, world.layer(), forward_batch)
    assert_output(out, expected, step.q.shape, tol, context)
    assert_kv_written(cache, ref_cache, step.out_cache_loc, context)
    return True


def _check_rotary_decode(factory, configure, world: World, seq_lens: list[int], tol: tuple[float, float],
                         context: str, generator: torch.Generator) -> None:
    """Where the backend applies the rotary embedding itself (``applies_rotary``), q and k passed before it with
    ``rotary=(cos, sin)`` attend like q and k rotated first (HF's ``rotate_half`` form, in the model dtype), and
    the K it writes is the rotated one."""
    step = make_step(world, ForwardMode.DECODE, [n - 1 for n in seq_lens], [1] * len(seq_lens), generator)
    cache = world.fresh_cache()
    backend = build_backend(factory, configure, world, cache)
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
    expected, ref_cache = reference(world, rotated)
    out = world.layer()(step.q, step.k, step.v, forward_batch, rotary=(cos, sin))
    assert_output(out, expected, step.q.shape, tol, context)
    for name in ("k", "v"):
        got = getattr(cache, f"{name}_buffers")[LAYER_ID][step.out_cache_loc].float().flatten(1)
        want = getattr(ref_cache, f"{name}_buffers")[LAYER_ID][step.out_cache_loc].flatten(1)
        assert_output(got, want, want.shape, tol, f"{context}: the {name.upper()} written at out_cache_loc")


def _check_verify(factory, configure, world: World, tokens: int, tol: tuple[float, float], context: str,
                  generator: torch.Generator, from_device_lengths: bool) -> None:
    """A TARGET_VERIFY step: every request ``tokens`` new tokens after a random prefix, each attending causally;
    ``from_device_lengths``: again with the host's upper bounds where the backend says it reads the device's."""
    prefix_lens = [int(torch.randint(0, n - tokens + 1, (1,), generator=generator)) for n in world.max_lens]
    step = make_step(world, ForwardMode.TARGET_VERIFY, prefix_lens, [tokens] * len(prefix_lens), generator)
    _check_prepared_step(factory, configure, world, step, tol,
                         f"TARGET_VERIFY of {tokens} tokens per request with {context}")
    if from_device_lengths:
        _check_prepared_step(factory, configure, world, step, tol,
                             f"TARGET_VERIFY of {tokens} tokens per request from the device's lengths "
                             f"(verifies_by_decode; the host's upper bounds, as in an overlapped verify step) with "
                             f"{context}", host_upper_bounds=True)


def _with_host_upper_bounds(forward_batch: ForwardBatch, world: World) -> ForwardBatch:
    """``forward_batch`` with the host's lengths an overlapped verify step has: ``seq_lens_cpu`` and ``seq_lens_sum``
    upper bounds (every draft of a previous step of :data:`HOST_SLACK` drafts kept: that many past each request's
    end, where its row holds later K/V or the padding slot's NaN) and no ``extend_prefix_lens_cpu``."""
    width = world.pool.req_to_token.shape[1]
    bounds = torch.clamp(forward_batch.seq_lens_cpu + HOST_SLACK, max=width)
    return dataclasses.replace(forward_batch, seq_lens_cpu=bounds, seq_lens_sum=int(bounds.sum()),
                               extend_prefix_lens_cpu=None)


def _check_tree_verify(factory, configure, world: World, tokens: int, tol: tuple[float, float], context: str,
                       generator: torch.Generator) -> None:
    """A TARGET_VERIFY step over draft trees (``supports_tree_mask``): each request's ``tokens`` new tokens form a
    random tree, each at the position of its depth past the prefix and attending to the prefix and its ancestors."""
    prefix_lens = [int(torch.randint(0, n - tokens + 1, (1,), generator=generator)) for n in world.max_lens]
    step = make_tree_step(world, prefix_lens, tokens, generator)
    _check_prepared_step(factory, configure, world, step, tol,
                         f"TARGET_VERIFY over draft trees of {tokens} tokens per request with {context}")
