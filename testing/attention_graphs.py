"""The attention conformance kit's CUDA-graph check: a DECODE or TARGET_VERIFY step captured at a padded batch
size and replayed with new lengths and inputs (see :mod:`treadle.testing.attention`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import torch

from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.testing.attention_world import (
    World, assert_kv_written, assert_output, build_backend, make_step, make_tree_step, reference,
)


def check_graph_replay(factory: Callable[[Any], Any], configure: Callable[[Any], None] | None, world: World,
                     tol: tuple[float, float], context: str, generator: torch.Generator,
                     tokens_per_req: int = 1, trees: bool = False) -> None:
    """Capture a step of ``tokens_per_req`` new tokens per request (1: DECODE, more: TARGET_VERIFY; ``trees``: over
    draft trees, the tree mask a static input) at a padded batch size, then replay it twice with new lengths and
    new inputs."""
    device, t = world.device, tokens_per_req
    mode = ForwardMode.TARGET_VERIFY if t > 1 else ForwardMode.DECODE
    real_bs = len(world.rows)
    graph_bs = real_bs + 3
    cache = world.fresh_cache()
    backend = build_backend(factory, configure, world, cache)
    backend.init_cuda_graph_state(graph_bs, graph_bs * t)
    # Padding rows attend over their own t tokens after fill - 1 cached ones.
    fill = int(backend.get_cuda_graph_seq_len_fill_value()) + t - 1
    static = _static_inputs(world, graph_bs, t, fill)
    forward_batch = _static_forward_batch(world, cache, backend, static, mode, graph_bs, t, fill)
    tree = {}
    if trees:  # padding rows keep a valid mask (a chain)
        static.tree_mask = torch.ones(t, t, device=device).tril().to(torch.uint8).repeat(graph_bs, 1, 1)
        forward_batch.tree_mask = tree["tree_mask"] = static.tree_mask
    layer = world.layer()
    backend.init_forward_metadata_capture_cuda_graph(graph_bs, graph_bs * t, static.rows, static.seq_lens, mode,
                                                     **tree)
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
        lens = [int(torch.randint(t, n + 1, (1,), generator=generator)) for n in world.max_lens]
        lens[replay % real_bs] = world.max_lens[replay % real_bs]
        prefix_lens = [n - t for n in lens]
        step = (make_tree_step(world, prefix_lens, t, generator) if trees
                else make_step(world, mode, prefix_lens, [t] * real_bs, generator))
        expected, ref_cache = reference(world, step)
        world.restore(cache)  # in place: the graph captured these buffers
        _load(static, step, lens, fill, t)
        extra = {"num_tokens": graph_bs * t} if t > 1 else {}
        backend.init_forward_metadata_replay_cuda_graph(
            graph_bs, static.rows, static.seq_lens, int(static.seq_lens_cpu.sum()), mode,
            seq_lens_cpu=static.seq_lens_cpu, **extra, **tree,
        )
        graph.replay()
        torch.cuda.synchronize(device)
        where = f"{context} (replay {replay + 1}, batch {real_bs} padded to {graph_bs})"
        assert_output(static_out[:real_bs * t], expected, step.q.shape, tol, where)
        assert_kv_written(cache, ref_cache, step.out_cache_loc, where)


def _static_inputs(world: World, graph_bs: int, t: int, fill: int) -> SimpleNamespace:
    device, s, n = world.device, world.shape, graph_bs * t
    seq_lens = torch.full((graph_bs,), fill, dtype=torch.int64, device=device)
    return SimpleNamespace(
        rows=torch.zeros(graph_bs, dtype=torch.int64, device=device),
        seq_lens=seq_lens,
        seq_lens_cpu=torch.full((graph_bs,), fill, dtype=torch.int64),
        prefix_lens=seq_lens - t,
        out_cache_loc=torch.zeros(n, dtype=torch.int64, device=device),
        positions=torch.zeros(n, dtype=torch.int64, device=device),
        tree_mask=None,
        q=torch.zeros(n, s.num_heads * s.head_dim, dtype=world.dtype, device=device),
        k=torch.zeros(n, s.num_kv_heads * s.head_dim, dtype=world.dtype, device=device),
        v=torch.zeros(n, s.num_kv_heads * s.head_dim, dtype=world.dtype, device=device),
    )


def _static_forward_batch(world: World, cache: Any, backend: Any, static: SimpleNamespace, mode: ForwardMode,
                          graph_bs: int, t: int, fill: int) -> ForwardBatch:
    device, n = world.device, graph_bs * t
    extend = {} if t == 1 else dict(
        extend_seq_lens=torch.full((graph_bs,), t, dtype=torch.int64, device=device),
        extend_prefix_lens=static.prefix_lens,
        extend_start_loc=torch.arange(graph_bs, dtype=torch.int64, device=device) * t,
        extend_seq_lens_cpu=[t] * graph_bs, extend_prefix_lens_cpu=[fill - t] * graph_bs,
    )
    return ForwardBatch(
        forward_mode=mode, batch_size=graph_bs,
        input_ids=torch.zeros(n, dtype=torch.int64, device=device),
        positions=static.positions,
        req_pool_indices=static.rows, seq_lens=static.seq_lens, seq_lens_cpu=static.seq_lens_cpu,
        out_cache_loc=static.out_cache_loc, seq_lens_sum=graph_bs * fill,
        logits_indices=torch.arange(n, device=device),
        req_to_token_pool=world.pool, kv_cache=cache, attn_backend=backend, tokens_per_req=t, **extend,
    )


def _load(static: SimpleNamespace, step: Any, lens: list[int], fill: int, t: int) -> None:
    """Copy a step's inputs into the static buffers; the rows past the real requests are padding."""
    real_bs, device = len(lens), static.seq_lens.device
    static.rows.zero_()
    static.rows[:real_bs].copy_(step.rows)
    static.seq_lens.fill_(fill)
    static.seq_lens[:real_bs].copy_(torch.tensor(lens, device=device))
    torch.sub(static.seq_lens, t, out=static.prefix_lens)
    static.seq_lens_cpu.fill_(fill)
    static.seq_lens_cpu[:real_bs].copy_(torch.tensor(lens))
    static.out_cache_loc.zero_()
    static.out_cache_loc[:real_bs * t].copy_(step.out_cache_loc)
    static.positions.zero_()
    static.positions[:real_bs * t].copy_(step.positions)
    if static.tree_mask is not None:
        static.tree_mask[:real_bs].copy_(step.tree_mask)
    for name in ("q", "k", "v"):
        getattr(static, name)[:real_bs * t].copy_(getattr(step, name))
