"""Fused-MoE kernel timing at Mixtral-8x7B's (or Qwen3-30B-A3B's) expert shapes, against the PyTorch expert loop.

``python -m treadle.bench.fused_moe [--tokens 1,8,64,512,4096] [--shape mixtral-8x7b|qwen3-30b-a3b] [--output PATH]
[--engine] [--sweep]``

For each token count: random bf16 activations routed over the experts of ``--shape`` (Mixtral-8x7B: top-2 of 8,
hidden 4096, intermediate 14336; Qwen3-30B-A3B: top-8 of 128, hidden 2048, intermediate 768), the Triton path
``fused_experts`` takes (the GEMVs for a few tokens, else the grouped GEMM; ``triton_ms``), the same captured once
in a CUDA graph and replayed (``graph_ms``: the GPU's time without the host's launches), the grouped GEMM
forced (eager and replayed: ``grouped_ms``, ``grouped_graph_ms``), the GEMVs forced up to 128 tokens
(replayed: ``gemv_graph_ms``; with ``grouped_graph_ms``, where ``takes_gemv``'s threshold comes from), the sort by expert alone (``align_ms``, and
``align_torch_ms`` for its PyTorch reference), and the reference loop, each timed with CUDA events (median of 20 runs after warm-up), plus the
bandwidth the default path reaches on the expert weights it must read (the experts that received at least one
token). ``--engine`` also serves a one-layer Mixtral-8x7B-shaped model (``load_format: dummy``) through the
Engine with CUDA graphs and reports decode tokens/s for 32 requests and for one (with the GEMVs and with the
grouped GEMM forced). ``--sweep`` also times a grid of tile configs per token count (CUDA-graph replays) and
reports the fastest and the default (input for ``fused_moe_kernels.default_config``). Writes JSON (``<results folder>/fused_moe_<gpu>_<date>.json``
unless ``--output``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from treadle.bench.results_folder import results_dir

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 4096, 14336, 8, 2
# (hidden, intermediate per expert, experts, experts per token)
SHAPES = {"mixtral-8x7b": (HIDDEN, INTERMEDIATE, EXPERTS, TOP_K), "qwen3-30b-a3b": (2048, 768, 128, 8)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64,512,4096")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mixtral-8x7b",
                        help="expert shapes (--engine serves Mixtral-8x7B's whatever this is)")
    parser.add_argument("--output")
    parser.add_argument("--fp8", action="store_true",
                        help="FP8 experts with a scale per weight row (as an FP8 checkpoint loads them)")
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("the fused-MoE benchmark needs a CUDA GPU")
    from treadle.kernels import fused_moe as fused_moe_kernels

    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter, experts, top_k = SHAPES[args.shape]
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
    scales: dict[str, torch.Tensor] = {}
    if args.fp8:
        s13, s2 = w13.float().abs().amax(dim=2) / 448, w2.float().abs().amax(dim=2) / 448
        w13 = (w13.float() / s13[..., None]).to(torch.float8_e4m3fn)
        w2 = (w2.float() / s2[..., None]).to(torch.float8_e4m3fn)
        scales = {"w13_scale": s13, "w2_scale": s2}
    expert_bytes = 3 * hidden * inter * w13.element_size()
    fp8_rows = args.fp8 and fused_moe_kernels.w8a8_enabled()  # the grouped GEMM's W8A8 tiles
    experts_under_test = _Experts(w13, w2, scales, experts, top_k, hidden, expert_bytes, fp8_rows, args.fp8)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        row = _measure_tokens(tokens, experts_under_test, generator, args.sweep)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "benchmark": "fused_moe", "gpu": torch.cuda.get_device_name(), "date": dt.date.today().isoformat(),
        "command": " ".join(["python -m treadle.bench.fused_moe", *(argv or sys.argv[1:])]),
        "shapes": {"name": args.shape, "hidden": hidden, "intermediate": inter, "experts": experts, "top_k": top_k,
                   "dtype": "bfloat16", "experts_dtype": "float8_e4m3fn" if args.fp8 else "bfloat16"},
        "rows": rows,
    }
    if args.engine:
        gemv_tokens = fused_moe_kernels.GEMV_MAX_TOKENS
        fused_moe_kernels.GEMV_MAX_TOKENS = 0  # the grouped GEMM at every size, for the comparison
        try:
            grouped = _engine_run(1)
        finally:
            fused_moe_kernels.GEMV_MAX_TOKENS = gemv_tokens
        result["engine"] = {"32 requests": _engine_run(32), "1 request": _engine_run(1),
                            "1 request, grouped GEMM": grouped}
        print(json.dumps(result["engine"]), flush=True)
    output = Path(args.output) if args.output else results_dir() / (
        f"fused_moe_{_slug(result['gpu'])}_{dt.date.today():%Y%m%d}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    return result


@dataclass
class _Experts:
    """The expert weights under test and what the rows report about them."""

    w13: torch.Tensor
    w2: torch.Tensor
    scales: dict[str, torch.Tensor]
    experts: int
    top_k: int
    hidden: int
    expert_bytes: int
    fp8_rows: bool
    fp8: bool


def _measure_tokens(tokens: int, moe: _Experts, generator: torch.Generator, sweep: bool) -> dict:
    """One row: every path's time for ``tokens`` tokens routed to ``moe``, and the kernel's error."""
    from treadle.kernels import fused_moe as fused_moe_kernels
    from treadle.layers import fused_moe

    w13, w2, scales, experts, top_k = moe.w13, moe.w2, moe.scales, moe.experts, moe.top_k
    hidden, expert_bytes, fp8_rows = moe.hidden, moe.expert_bytes, moe.fp8_rows
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    weights, ids = fused_moe.route_top_k(torch.randn(tokens, experts, device="cuda", generator=generator), top_k)
    triton_ms = _time(lambda: fused_moe_kernels.fused_experts(x, w13, w2, weights, ids, **scales))
    graph_ms = _time_graph(lambda: fused_moe_kernels.fused_experts(x, w13, w2, weights, ids, **scales))
    grouped = fused_moe_kernels.default_config(tokens * top_k, torch.bfloat16, fp8_rows=fp8_rows)
    grouped_ms = _time(lambda: fused_moe_kernels.fused_experts(x, w13, w2, weights, ids, grouped, **scales))
    grouped_graph_ms = _time_graph(
        lambda: fused_moe_kernels.fused_experts(x, w13, w2, weights, ids, grouped, **scales))
    # The GEMVs forced (up to 128 tokens: their cost grows with every assignment), for the threshold.
    gemv_graph_ms = _time_graph(lambda: fused_moe_kernels.fused_experts_gemv(
        x, w13, w2, weights, ids, **scales)) if tokens <= 128 else None
    align_ms = _time(lambda: fused_moe_kernels.align_by_expert(ids, experts, grouped.block_m))
    align_torch_ms = _time(lambda: fused_moe_kernels.align_by_expert_reference(ids, experts, grouped.block_m))
    torch_ms = _time(lambda: fused_moe.fused_experts_reference(x, w13, w2, weights, ids, *scales.values()))
    got = fused_moe_kernels.fused_experts(x, w13, w2, weights, ids, **scales).float()
    want = fused_moe.fused_experts_reference(x, w13, w2, weights, ids, *scales.values()).float()
    active = int(torch.unique(ids).numel())
    row = {
        "tokens": tokens, "path": "gemv" if fused_moe_kernels.takes_gemv(tokens, top_k, experts, moe.fp8) else "grouped",
        "triton_ms": round(triton_ms, 4), "graph_ms": round(graph_ms, 4), "grouped_ms": round(grouped_ms, 4),
        "grouped_graph_ms": round(grouped_graph_ms, 4),
        "gemv_graph_ms": round(gemv_graph_ms, 4) if gemv_graph_ms is not None else None,
        "align_ms": round(align_ms, 4),
        "align_torch_ms": round(align_torch_ms, 4),
        "torch_loop_ms": round(torch_ms, 4), "speedup": round(torch_ms / triton_ms, 2), "experts_hit": active,
        "weight_gbps": round(active * expert_bytes / triton_ms / 1e6, 1),
        "max_rel_diff": float((got - want).abs().max() / want.abs().max()),
    }
    if sweep:
        row["sweep"] = _sweep(
            lambda config: fused_moe_kernels.fused_experts(x, w13, w2, weights, ids, config, **scales),
            tokens * top_k, fp8_rows)
    return row


def _sweep(run, num_rows: int, fp8_rows: bool = False) -> list[dict]:
    """The five fastest tile configs for ``num_rows`` (token, expert) rows, each replayed from a CUDA graph (the
    GPU's time; configs that fail to compile are skipped), and the default config's time for reference."""
    from treadle.kernels.fused_moe import BlockConfig, default_config

    block_ms = (16,) if num_rows <= 64 else (16, 32, 64) if num_rows <= 4096 else (64, 128)
    default = default_config(num_rows, torch.bfloat16, fp8_rows=fp8_rows)
    timings = []
    for block_m in block_ms:
        for block_n in (64, 128):
            for block_k in (64, 128, 256):
                for num_warps, num_stages in ((4, 4), (8, 3)):
                    config = BlockConfig(block_m, block_n, block_k, num_warps, num_stages)
                    try:
                        run(config)  # compiles outside the capture
                        ms = _time_graph(lambda: run(config))
                    except Exception:  # e.g. shared memory exceeded for the largest tiles
                        continue
                    timings.append({**config.__dict__, "ms": round(ms, 4), "default": config == default})
    best = sorted(timings, key=lambda t: t["ms"])
    return best[:5] + [t for t in best[5:] if t["default"]]


def _time(run, repeats: int = 20) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _time_graph(run) -> float:
    """:func:`_time` of ``run`` captured once in a CUDA graph and replayed (``run`` has run before, so its kernels
    are compiled outside the capture)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return _time(graph.replay)


def _engine_run(requests: int) -> dict:
    """One Mixtral-8x7B-shaped layer with dummy weights, ``requests`` prompts served through the Engine (CUDA graphs
    on)."""
    from treadle import Engine, SamplingParams

    config = {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": 1, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K,
        "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
        "torch_dtype": "bfloat16",
    }
    folder = tempfile.mkdtemp(prefix="mixtral-shape-")
    Path(folder, "config.json").write_text(json.dumps(config))
    engine = Engine({
        "model": {"path": folder, "load_format": "dummy", "dtype": "bfloat16", "context_length": 2048},
        "attention": {"backend": "triton"},
        "cache": {"max_total_tokens": 65536},
        "scheduler": {"max_running_requests": 32},
        "runtime": {"cuda_graph_max_bs": 32},
    })
    prompts = [[(7 * i + j) % 32000 for j in range(128)] for i in range(requests)]
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    engine.generate(input_ids=prompts, sampling_params=params)  # untimed: compiles what the timed pass runs
    engine.flush_cache()
    start = time.perf_counter()
    outputs = engine.generate(input_ids=prompts, sampling_params=params)
    seconds = time.perf_counter() - start
    engine.shutdown()
    generated = sum(len(o.token_ids) for o in outputs)
    return {"requests": len(prompts), "input_len": 128, "output_len": 64, "seconds": round(seconds, 3),
            "output_tok_per_s": round(generated / seconds, 1)}


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


if __name__ == "__main__":
    main()
