"""The LoRA delta split around the layer's matmul (kernels/lora_fused.py through ``layers/small_batch.split_matmul``)
on the GPU, at Llama-3.1-8B's shapes, captured in CUDA graphs and replayed with other adapter ids: bit for bit what
the unfused path computes (the matmul, the gather shrink and expand, then ``silu_mul`` / add + RMSNorm) when its
shrink reduces over as many warps as the matmul's launch (the shrink's float32 sums are associated by the launch's
warps: the only difference), and within a rounding of today's unfused path as it launches; where the shrink runs
apart (beside cuBLAS, config None; ``down_proj``'s tile at 32 tokens) bit for bit today's path. The engine with
``fuse_gemv`` on and off gives the same greedy tokens (or parts at a near-tie), on the timed small-batch kernels and
on cuBLAS alone (``TREADLE_SMALL_BATCH_MATMUL=library``).

Run on the device machine: ``python -m pytest -q tests/gpu/test_lora_fused_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SLOTS, RANK = 8, 16
# layer -> (in, column segments of its output)
LAYERS = {"qkv": (4096, ((0, 4096), (4096, 5120), (5120, 6144))), "o_proj": (4096, ((0, 4096),)),
          "gate_up": (4096, ((0, 14336), (14336, 28672))), "down_proj": (14336, ((0, 4096),))}


def _configs(tokens: int):
    """The small-batch configs to split around, and None: the library matmul (cuBLAS)."""
    from treadle.kernels.small_batch import SmallBatchConfig

    if tokens == 1:  # the GEMVs the loader picks among at one row
        return [SmallBatchConfig(4, 2048, 8, 4, gemv=True), SmallBatchConfig(16, 256, 4, 3, split_k=4, gemv=True),
                None]
    return [SmallBatchConfig(32, 128, 4, 4), SmallBatchConfig(128, 128, 4, 4),
            SmallBatchConfig(32, 128, 4, 4, split_k=4), None]


def _matmul(case: dict, config):
    import torch.nn.functional as F

    from treadle.kernels.small_batch import small_batch_matmul

    if config is None:
        return F.linear(case["x"], case["weight"])
    return small_batch_matmul(case["x"], case["weight"], None, config)


def _case(layer: str, tokens: int):
    in_features, segments = LAYERS[layer]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    count, width = len(segments), segments[-1][1]
    ranks = torch.tensor([[16, 8, 3, 0, 16, 1, 12, 16]] * count, dtype=torch.int32, device="cuda")
    ranks[-1, 3] = 5  # ranks differ per projection
    a = torch.randn(SLOTS, count * RANK, in_features, device="cuda", generator=gen) / in_features ** 0.5
    b = torch.randn(SLOTS, width, RANK, device="cuda", generator=gen) / RANK ** 0.5
    for p, (start, end) in enumerate(segments):
        for slot in range(SLOTS):
            rank = int(ranks[p, slot])
            a[slot, p * RANK + rank:(p + 1) * RANK] = 0
            b[slot, start:end, rank:] = 0
    return {"x": torch.randn(tokens, in_features, device="cuda", generator=gen).bfloat16(),
            "weight": (torch.randn(width, in_features, device="cuda", generator=gen) / in_features ** 0.5).bfloat16(),
            "a": a.bfloat16(), "b": b.bfloat16(), "ids": torch.zeros(tokens, dtype=torch.int64, device="cuda"),
            "scalings": torch.rand(count, SLOTS, device="cuda", generator=gen) + 0.5, "ranks": ranks,
            "segments": segments, "residual": torch.randn(tokens, 4096, device="cuda", generator=gen).bfloat16(),
            "norm_weight": (torch.rand(4096, device="cuda", generator=gen) + 0.5).bfloat16()}


def _unfused(layer: str, case: dict, config, shrink_warps: int | None):
    """Today's path; ``shrink_warps``: its shrink launched with that many warps."""
    from treadle.kernels import fused, lora
    from treadle.kernels.lora_choice import DEFAULT
    from treadle.kernels.small_batch import small_batch_matmul

    x, a, ids = case["x"], case["a"], case["ids"]

    def add_delta(out: torch.Tensor) -> None:
        split = lora._gather_shrink_blocks(x.shape[0], a.shape[1], x.shape[1], True, DEFAULT)[3]
        partials = torch.empty((split, x.shape[0], a.shape[1]), dtype=torch.float32, device="cuda")
        warps = lora._gather_warps
        if shrink_warps is not None:
            lora._gather_warps = lambda tile: shrink_warps
        try:
            lora._shrink(x, a, ids, case["scalings"], case["ranks"], RANK, partials, False, DEFAULT)
        finally:
            lora._gather_warps = warps
        lora._expand(partials, case["scalings"], case["b"], ids, case["ranks"], case["segments"], out, DEFAULT)

    if layer in ("o_proj", "down_proj"):
        if x.shape[0] == 1 and config is not None and config.gemv:  # the deltas join the residual, then the GEMV's
            moved = case["residual"].clone()                            # add + RMSNorm
            add_delta(moved)
            return torch.cat(small_batch_matmul(x, case["weight"], None, config,
                                                add_rmsnorm=(moved, case["norm_weight"], 1e-5)), 1)
        y = _matmul(case, config)
        add_delta(y)
        return torch.cat(fused.add_rmsnorm(y, case["residual"], case["norm_weight"], 1e-5), 1)
    y = _matmul(case, config)
    add_delta(y)
    return fused.silu_mul(y) if layer == "gate_up" else y


def _split_lora(case: dict):
    from treadle.kernels import lora_fused
    from treadle.kernels.lora_choice import DEFAULT

    return lora_fused.split_lora(case["x"], case["a"], case["b"], case["ids"], case["scalings"], case["ranks"],
                                 case["segments"], DEFAULT)


def _split(layer: str, case: dict, config):
    """Through the layers' seam: the shrink in the matmul's launch, or apart (cuBLAS, or a tile past fuse_tile)."""
    import torch.nn.functional as F

    from treadle.layers import small_batch

    split = _split_lora(case)
    kernels = None if config is None else small_batch.SmallBatchKernels((config,) * len(small_batch.ROW_BUCKETS))

    def run(**epilogue):
        return small_batch.split_matmul(kernels, case["x"], case["weight"], lambda: split, library=F.linear,
                                        **epilogue)

    if layer == "gate_up":
        return run(silu_mul=True)
    if layer in ("o_proj", "down_proj"):
        return torch.cat(run(add_rmsnorm=(case["residual"], case["norm_weight"], 1e-5)), 1)
    return run()


def _graphed(run):
    """``run()`` captured in a CUDA graph (warmed up first); returns (graph, its output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


@pytest.mark.parametrize("tokens", [1, 32])
@pytest.mark.parametrize("layer", list(LAYERS))
def test_split_equals_the_unfused_path_in_cuda_graphs(layer, tokens):
    case = _case(layer, tokens)
    for config in _configs(tokens):
        apart = config is None or _split_lora(case).beside is None  # then the same shrink kernel as today's
        graphs = {"split": _graphed(lambda: _split(layer, case, config)),
                  "today": _graphed(lambda: _unfused(layer, case, config, None))}
        if not apart:  # the shrink in the matmul's launch reduces over its warps
            graphs["same_warps"] = _graphed(lambda: _unfused(layer, case, config, config.num_warps))
        gen = torch.Generator().manual_seed(7)
        for replay in range(3):  # other adapters each replay: one slot for all, then mixed with tokens of none
            ids = torch.full((tokens,), 2) if replay == 0 else torch.randint(-1, SLOTS, (tokens,), generator=gen)
            case["ids"].copy_(ids)
            for graph, _ in graphs.values():
                graph.replay()
            torch.cuda.synchronize()
            split, today = graphs["split"][1], graphs["today"][1]
            assert torch.equal(split, graphs["today" if apart else "same_warps"][1]), (layer, tokens, str(config),
                                                                                       replay)
            torch.testing.assert_close(split.float(), today.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("matmul", ["auto", "library"])
def test_engine_tokens_with_and_without_the_split(real_shape_llama_dir, tmp_path, monkeypatch, matmul):
    """bf16 decode graphs through the small-batch kernels the loader times (or cuBLAS alone): fuse_gemv on and
    off."""
    from near_tie import assert_plain_or_near_tie
    from peft_adapters import ALL_PROJECTIONS, make_peft_adapter
    from treadle import Engine

    adapters = {"all16": make_peft_adapter(real_shape_llama_dir, tmp_path / "all16", rank=16,
                                           targets=ALL_PROJECTIONS, std=0.03)}
    config = {"model": {"path": real_shape_llama_dir, "dtype": "bfloat16", "device": "cuda", "context_length": 2048},
              "cache": {"max_total_tokens": 16384}, "runtime": {"cuda_graph_max_bs": 16},
              "lora": {"paths": adapters, "backend": "triton", "max_rank": 16, "max_loras_per_batch": 4},
              "plugins": ["treadle.plugins.lora_backends.triton"]}
    prompts, names = [[5, 17, 42, 8, 99, 3], [300, 301, 9], [1000, 1001, 1002, 40]], ["all16", None, "all16"]
    outputs = {}
    monkeypatch.setenv("TREADLE_SMALL_BATCH_MATMUL", matmul)  # read as the layers load
    for fuse in ("1", "0"):
        monkeypatch.setenv("TREADLE_LORA_KERNELS", f"fuse_gemv={fuse},fuse_max_tokens=64")  # read when built
        with Engine(config) as engine:
            for single in (True, False):  # one request (bs=1: the GEMVs), then three
                batch = prompts[:1] if single else prompts
                outputs[fuse, single] = engine.generate(
                    input_ids=batch, lora_path=names[:len(batch)], return_logprob=True, top_logprobs_num=2,
                    sampling_params={"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True})
    for single in (True, False):
        assert_plain_or_near_tie(outputs["1", single], outputs["0", single], min_equal=0 if single else 1)
