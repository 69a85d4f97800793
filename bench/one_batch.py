"""One-batch latency: prefill one static batch, then time each decode step, per attention backend.

``treadle bench one-batch [--batch-sizes 1,32] [--input-len 512] [--decode-steps 128]
[--backends torch_native,triton,flashinfer] [--graphs on,off] [--compare SPEC] [--no-hf] [--no-profile]``

The model is Llama-3.1-8B's shape (its config.json written to a temp folder;
``--model`` takes another HF folder) with ``load_format: dummy`` weights in
bfloat16. Each variant (backend x CUDA graphs on/off) gets a fresh ModelRunner
and, per batch size, runs one EXTEND batch of ``--input-len`` random tokens per
request, then ``--decode-steps`` greedy DECODE steps driven on the device
(argmax feeds the next step; no host round trip), each step timed with a
device synchronize — the latency a user of the batch sees.

In the same run:
- the bandwidth roofline: bytes a decode step must read (every weight except
  the embedding table, the embedding rows looked up, and the KV cache of every
  request at the mean decode length) over the device-to-device copy bandwidth
  measured here (a 1 GiB copy, counting bytes read + written);
- HF transformers ``generate`` on the same weights (treadle's copied into
  ``LlamaForCausalLM``), bf16, default dynamic cache, eager: decode per step
  = (time for ``decode-steps`` tokens - time for 1 token) / (steps - 1);
- ``hf-compiled``: the same with a ``StaticCache`` (``cache_implementation="static"``),
  on which ``generate`` compiles the decode forward with ``torch.compile``
  (mode ``reduce-overhead``: CUDA graphs); its compilation happens in an untimed
  warm-up (skip it with ``--no-hf-compiled``);
- with a GPU, a torch.profiler summary of bs=1 graph decode per backend (top
  kernels, time by kind, and how much of the step the GPU is busy).

A backend may be given tunables: ``--backends flashinfer:use_tensor_cores=false``.
``--compare`` runs every backend once per config variant, as in ``treadle bench offline``: a
comma-separated list of ``;``-separated ``KEY=VALUE`` overrides, e.g.
``--compare "model.quantization=null,model.quantization=fp8"`` (bf16 vs FP8 weights; the roofline
counts each parameter's real bytes, so FP8 weights halve it); ``fp8_small_batch_kernel=scaled_mm``
forces the FP8 kernel for decode-sized batches (see plugins/models/fp8.py).

Prints a table and writes JSON (``bench/results/one_batch_<gpu>_<date>.json``
unless ``--output``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from treadle.bench.step_meter import kernel_category

RESULTS_DIR = Path(__file__).resolve().parent / "results"

LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3",
    },
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
# Llama-3.1-70B's shape: does not fit one 80 GB GPU in bf16 (141 GB); run it with --tp 2 on H200s.
LLAMA_3_1_70B: dict[str, Any] = {
    **LLAMA_3_1_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8,
}
SHAPES = {"llama-3.1-8b": LLAMA_3_1_8B, "llama-3.1-70b": LLAMA_3_1_70B}
# A few-layer model of the same kind, for smoke tests on the CPU.
TINY: dict[str, Any] = {
    **LLAMA_3_1_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
}


@dataclass
class Measurement:
    """One system at one batch size."""

    system: str
    backend: str | None
    cuda_graph: bool | None
    batch_size: int
    prefill_ms: float
    decode_step_ms: float  # median
    decode_step_ms_mean: float
    decode_tokens_per_s: float
    roofline_ms: float
    roofline_fraction: float
    first_tokens: list[int] = field(default_factory=list)
    ratio_vs_baseline: float | None = None  # tok/s vs the same system and batch size of an earlier run


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.tp > 1:
        return _run_tensor_parallel(args, list(argv if argv is not None else sys.argv[1:]))
    return _measure(args, argv)


def _run_tensor_parallel(args: argparse.Namespace, argv: list[str]) -> int:
    """``--tp N``: N processes (one GPU each; gloo on the CPU) run the same batches in lockstep; rank 0
    reports. The roofline is per GPU: each reads its shard of the weights and KV at the same time."""
    import torch.multiprocessing as mp

    store = Path(tempfile.mkdtemp(prefix="treadle-bench-tp-")) / "store"
    mp.start_processes(_tensor_parallel_rank, args=(args.tp, str(store), argv), nprocs=args.tp, start_method="spawn")
    return 0


def _tensor_parallel_rank(rank: int, tp_size: int, store: str, argv: list[str]) -> None:
    import contextlib
    import io

    from treadle.core.parallel import destroy_tensor_parallel, init_tensor_parallel

    args = _parser().parse_args(argv)
    args.no_hf = args.no_profile = True  # HF and the profiler see one rank's shard only
    device = _device(args)
    init_tensor_parallel(rank, tp_size, f"file://{store}",
                         torch.device("cuda", rank) if device.type == "cuda" else device, timeout_s=1800)
    try:
        if rank == 0:
            _measure(args, argv)
        else:
            args.output = str(Path(store).parent / f"rank{rank}.json")
            with contextlib.redirect_stdout(io.StringIO()):
                _measure(args, argv)
    finally:
        destroy_tensor_parallel()


def _device(args: argparse.Namespace) -> torch.device:
    return torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))


def _measure(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    device = _device(args)
    if device.type == "cuda":
        from treadle.core.parallel import get_tp_rank

        device = torch.device("cuda", get_tp_rank())
    torch.manual_seed(0)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    graphs = [g == "on" for g in args.graphs.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model or _write_config(Path(scratch), TINY if args.tiny else SHAPES[args.shape])
        bandwidth = measure_copy_bandwidth(device)
        print(f"device-to-device copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + write)")
        prompts = {bs: torch.randint(100, 1000, (bs, args.input_len)) for bs in batch_sizes}
        results: list[Measurement] = []
        skipped: dict[str, str] = {}
        profiles: dict[str, Any] = {}
        hf_done = args.no_hf
        variants = [v.strip() for v in args.compare.split(",")] if args.compare else [""]
        for variant, spec, use_graph in [(v, s, g) for v in variants for s in args.backends.split(",") for g in graphs]:
            backend, options = parse_backend_spec(spec)
            label = f"{spec} graphs={'on' if use_graph else 'off'}" + (f" [{variant}]" if variant else "")
            try:
                runner = _build_runner(model_dir, backend, options, use_graph, max(batch_sizes), args, device,
                                       variant)
            except Exception as exc:  # a backend missing on this machine is reported, not fatal
                skipped[label] = f"{type(exc).__name__}: {exc}"
                print(f"skipped {label}: {skipped[label]}")
                continue
            if use_graph and runner.cuda_graph_runner is None:
                skipped[label] = "no CUDA graphs here (CPU, or the backend does not support them)"
                runner = _release(runner)
                continue
            for bs in batch_sizes:
                results.append(run_treadle(runner, label, backend, use_graph, prompts[bs], args, bandwidth))
                print(_row(results[-1]))
            if use_graph and device.type == "cuda" and not args.no_profile and 1 in prompts:
                profiles[label] = profile_decode(runner, label, prompts[1])
            if not hf_done:
                hf_done = True
                for compiled in ([False] if args.no_hf_compiled or device.type != "cuda" else [False, True]):
                    for bs in batch_sizes:
                        try:
                            results.append(run_hf(runner, prompts[bs], args, bandwidth, compiled=compiled))
                        except Exception as exc:  # a compile failure is reported, not fatal
                            skipped[f"hf-compiled bs={bs}"] = f"{type(exc).__name__}: {exc}"[:500]
                            print(f"skipped hf-compiled bs={bs}: {skipped[f'hf-compiled bs={bs}']}")
                            continue
                        print(_row(results[-1]))
            runner = _release(runner)
    if args.baseline:
        fill_baseline_ratios(results, json.loads(Path(args.baseline).read_text()))
    print()
    print(format_table(results))
    for profile in profiles.values():
        print()
        print(format_profile(profile))
    report = {
        "benchmark": "one_batch",
        "command": "treadle bench one-batch " + shlex.join(list(argv if argv is not None else sys.argv[1:])),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "model": "tiny" if args.tiny else (args.model or f"{args.shape} shapes, dummy weights"),
        "tp_size": args.tp,
        "dtype": args.dtype,
        "input_len": args.input_len,
        "decode_steps": args.decode_steps,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "results": [asdict(r) for r in results],
        "skipped": skipped,
        "profiles_bs1": profiles,
        "fp8_small_batch_kernels": _fp8_choices(),
    }
    output = Path(args.output) if args.output else RESULTS_DIR / _default_name(report["machine"]["gpu"])
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {output}")
    return 0


# ------------------------------------------------------------------------------------------------
# treadle
# ------------------------------------------------------------------------------------------------


def parse_backend_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name:attr=value:attr=value`` (backend tunables, e.g. ``flashinfer:use_tensor_cores=false``)."""
    import yaml

    name, *assignments = spec.split(":")
    options = {}
    for assignment in assignments:
        if "=" not in assignment:
            raise SystemExit(f"backend option '{assignment}' in '{spec}' must look like attr=value")
        attr, value = assignment.split("=", 1)
        options[attr] = yaml.safe_load(value)
    return name, options


def _build_runner(model_dir: str, backend: str, options: dict[str, Any], use_graph: bool, max_bs: int,
                  args: argparse.Namespace, device: torch.device, variant: str = "") -> Any:
    """A ModelRunner whose backend gets ``options`` set before any CUDA graph is captured; ``variant``
    is ``KEY=VALUE;...`` config overrides (plus ``fp8_small_batch_kernel``)."""
    from treadle.core.config import load_config
    from treadle.core.cuda_graph import CudaGraphRunner
    from treadle.core.model_runner import ModelRunner
    from treadle.core.registry import build_registry

    slots_per_request = _round_up(args.input_len + args.decode_steps + 1, args.page_size)
    config = load_config(overrides={
        "model.path": model_dir, "model.load_format": "dummy", "model.dtype": args.dtype,
        "model.device": device.type, "model.context_length": args.context_length,
        "attention.backend": backend,
        "cache.kv_allocator": "token" if args.page_size == 1 else "paged", "cache.page_size": args.page_size,
        "cache.max_total_tokens": max_bs * slots_per_request,
        "scheduler.max_running_requests": max_bs,
        "runtime.disable_cuda_graph": True, "runtime.cuda_graph_max_bs": max_bs,
        **_variant_overrides(variant),
    }, use_env=False)
    runner = ModelRunner(config, build_registry())
    for attr, value in options.items():
        if not hasattr(runner.attn_backend, attr):
            raise ValueError(f"attention backend '{backend}' has no tunable '{attr}'")
        setattr(runner.attn_backend, attr, value)
    if use_graph and device.type == "cuda" and getattr(runner.attn_backend, "supports_cuda_graph", False):
        runner.config.runtime.disable_cuda_graph = False
        runner.cuda_graph_runner = CudaGraphRunner(runner)
    return runner


@dataclass
class _Batch:
    """Requests occupying req_to_token rows 0..bs-1, each on its own contiguous run of pages."""

    rows: torch.Tensor  # [bs] device
    slots: torch.Tensor  # [bs, max_len] device int64


def _place_batch(runner: Any, bs: int, max_len: int) -> _Batch:
    page = runner.page_size
    span = _round_up(max_len, page)
    slots = page + torch.arange(bs)[:, None] * span + torch.arange(max_len)[None, :]
    rows = torch.arange(bs)
    runner.req_to_token_pool.req_to_token[rows[:, None], torch.arange(max_len)[None, :]] = (
        slots.to(device=runner.device, dtype=torch.int32))
    return _Batch(rows.to(runner.device), slots.to(runner.device))


def _prefill(runner: Any, batch: _Batch, prompts: torch.Tensor) -> torch.Tensor:
    from treadle.core.forward_batch import ForwardBatch, ForwardMode

    bs, length = prompts.shape
    device = runner.device
    lens = torch.full((bs,), length, dtype=torch.int64)
    starts = torch.arange(bs, dtype=torch.int64) * length
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=bs,
        input_ids=prompts.flatten().to(device), positions=torch.arange(length).repeat(bs).to(device),
        req_pool_indices=batch.rows, seq_lens=lens.to(device), seq_lens_cpu=lens,
        out_cache_loc=batch.slots[:, :length].flatten(), seq_lens_sum=bs * length,
        logits_indices=(starts + length - 1).to(device),
        req_to_token_pool=runner.req_to_token_pool, kv_cache=runner.kv_cache, attn_backend=runner.attn_backend,
        extend_seq_lens=lens.to(device), extend_prefix_lens=torch.zeros(bs, dtype=torch.int64, device=device),
        extend_start_loc=starts.to(device), extend_seq_lens_cpu=[length] * bs, extend_prefix_lens_cpu=[0] * bs,
    )
    return runner.forward(forward_batch).argmax(-1)


def _decode_step(runner: Any, batch: _Batch, next_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One greedy decode step for every request at sequence length ``seq_len`` (this token included)."""
    from treadle.core.forward_batch import ForwardBatch, ForwardMode

    bs = int(next_ids.shape[0])
    device = runner.device
    seq_lens_cpu = torch.full((bs,), seq_len, dtype=torch.int64)
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=next_ids,
        positions=torch.full((bs,), seq_len - 1, dtype=torch.int64, device=device),
        req_pool_indices=batch.rows, seq_lens=torch.full((bs,), seq_len, dtype=torch.int64, device=device),
        seq_lens_cpu=seq_lens_cpu, out_cache_loc=batch.slots[:, seq_len - 1].contiguous(),
        seq_lens_sum=bs * seq_len, logits_indices=torch.arange(bs, device=device),
        req_to_token_pool=runner.req_to_token_pool, kv_cache=runner.kv_cache, attn_backend=runner.attn_backend,
    )
    return runner.forward(forward_batch).argmax(-1)


def run_treadle(runner: Any, label: str, backend: str, use_graph: bool, prompts: torch.Tensor,
                args: argparse.Namespace, bandwidth: float) -> Measurement:
    bs, input_len = prompts.shape
    batch = _place_batch(runner, bs, input_len + args.decode_steps + 1)
    device = runner.device
    for _ in range(args.warmup):  # the warm-up pass also compiles kernels
        next_ids = _prefill(runner, batch, prompts)
        for step in range(min(4, args.decode_steps)):
            next_ids = _decode_step(runner, batch, next_ids, input_len + step + 1)
    _sync(device)
    start = time.perf_counter()
    next_ids = _prefill(runner, batch, prompts)
    _sync(device)
    prefill_s = time.perf_counter() - start
    step_times, first_tokens = [], [int(next_ids[0])]
    for step in range(args.decode_steps):
        start = time.perf_counter()
        next_ids = _decode_step(runner, batch, next_ids, input_len + step + 1)
        _sync(device)
        step_times.append(time.perf_counter() - start)
        if step < 15:
            first_tokens.append(int(next_ids[0]))
    return _measurement(f"treadle {label}", backend, use_graph, bs, prefill_s, step_times, first_tokens,
                        roofline_seconds(runner.model, runner, bs, input_len, args.decode_steps, bandwidth))


def roofline_seconds(model: torch.nn.Module, runner: Any, bs: int, input_len: int, steps: int,
                     bandwidth: float) -> float:
    """Bytes one decode step must read (weights + KV at the mean decode length) over ``bandwidth``."""
    embedding = model.get_submodule("model.embed_tokens").weight
    seen, weight_bytes = set(), 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        weight_bytes += param.numel() * param.element_size()
    lm_head = model.get_submodule("lm_head").weight
    if lm_head is not embedding:  # an untied table is only gathered: bs rows, not all of it
        weight_bytes -= embedding.numel() * embedding.element_size()
        weight_bytes += bs * embedding.shape[1] * embedding.element_size()
    mean_len = input_len + (steps + 1) / 2
    kv_bytes = bs * mean_len * 2 * runner.num_layers * runner.num_kv_heads * runner.head_dim * \
        runner.kv_cache.k_buffers[0].element_size()
    return (weight_bytes + kv_bytes) / bandwidth


# ------------------------------------------------------------------------------------------------
# HF transformers
# ------------------------------------------------------------------------------------------------


HF_COMPILED = "hf-compiled"


def run_hf(runner: Any, prompts: torch.Tensor, args: argparse.Namespace, bandwidth: float,
           compiled: bool = False) -> Measurement:
    """HF ``generate`` eager with its dynamic cache, or (``compiled``) with a static cache and torch.compile."""
    model = _hf_model_with_weights_of(runner)
    device = runner.device
    ids = prompts.to(device)
    mask = torch.ones_like(ids)
    bs, input_len = prompts.shape
    cache = None
    if compiled:
        from transformers import StaticCache

        # One cache length for every call, so the compiled decode step is built (and graph-captured) once.
        cache = StaticCache(config=model.config, max_cache_len=input_len + args.decode_steps + 8)

    def generate(new_tokens: int) -> tuple[float, torch.Tensor]:
        kwargs: dict[str, Any] = {}
        if cache is not None:
            cache.reset()
            kwargs["past_key_values"] = cache
        _sync(device)
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs)
        _sync(device)
        return time.perf_counter() - start, out

    with torch.inference_mode():
        generate(4)  # warm-up (compiles the decode step)
        if compiled:
            generate(8)
        one, _ = generate(1)
        full, out = generate(args.decode_steps)
    step = (full - one) / max(args.decode_steps - 1, 1)
    first_tokens = out[0, input_len:input_len + 16].tolist()
    name = "HF generate, static cache + torch.compile" if compiled else "HF transformers generate"
    result = _measurement(name, HF_COMPILED if compiled else None, None, bs, one, [step], first_tokens,
                          roofline_seconds(runner.model, runner, bs, input_len, args.decode_steps, bandwidth))
    del model
    _free()
    return result


def _hf_model_with_weights_of(runner: Any) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(runner.model_dir)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(runner.dtype)
    try:
        with torch.device(runner.device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    model = model.to(runner.dtype).eval()
    params = dict(model.named_parameters())
    copied = set()
    with torch.no_grad():
        for name, tensor in hf_named_weights(runner.model):
            if name in params:
                params[name].copy_(tensor)
                copied.add(name)
    missing = sorted(set(params) - copied)
    if missing:
        raise RuntimeError(f"HF model parameters not filled from treadle's weights: {missing[:5]}")
    return model


def hf_named_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """treadle's parameters under HF checkpoint names (stacked projections split back into their shards;
    FP8 weights widened with their scales, so HF runs the same weights)."""
    named = []
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if param_name == "weight_scale":
                continue
            if param_name == "weight" and hasattr(module, "weight_scale"):
                param = (param.float() * module.weight_scale.float()).to(module.fp8_out_dtype)
            if getattr(module, "shard_ids", None):
                parent = module_name.rpartition(".")[0]
                for shard, (offset, rows) in module.shards.items():
                    named.append((f"{parent}.{shard}.{param_name}", param.narrow(0, offset, rows)))
            else:
                named.append((f"{module_name}.{param_name}", param))
    return named


# ------------------------------------------------------------------------------------------------
# Bandwidth, profile, report
# ------------------------------------------------------------------------------------------------


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read plus bytes written (median)."""
    if device.type != "cuda":
        nbytes, iters = 1 << 26, 5
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 3):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - start)
    del src, dst
    _free()
    return 2 * nbytes / statistics.median(times)


def profile_decode(runner: Any, label: str, prompt: torch.Tensor, steps: int = 20) -> dict[str, Any]:
    """torch.profiler over ``steps`` bs=1 decode steps: top kernels and GPU busy time per step."""
    from torch.profiler import ProfilerActivity, profile

    input_len = prompt.shape[1]
    batch = _place_batch(runner, 1, input_len + steps + 2)
    host_us = {"runner.forward (host, until the graph is launched)": 0.0,
               "attention backend replay metadata (host)": 0.0}
    backend = runner.attn_backend
    timed = [(runner, "forward", "runner.forward (host, until the graph is launched)"),
             (backend, "init_forward_metadata_replay_cuda_graph", "attention backend replay metadata (host)")]
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in timed]
    for (obj, name, original), (_, _, key) in zip(originals, timed):
        setattr(obj, name, _host_timer(original, host_us, key))
    next_ids = _prefill(runner, batch, prompt)
    next_ids = _decode_step(runner, batch, next_ids, input_len + 1)
    _sync(runner.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for step in range(steps):
            next_ids = _decode_step(runner, batch, next_ids, input_len + step + 2)
            _sync(runner.device)
        wall = (time.perf_counter() - start) / steps
    for obj, name, _ in originals:
        delattr(obj, name)  # drop the instance attribute: the class method shows through again
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        if device_us and event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append({"name": event.key[:90], "calls_per_step": event.count / steps,
                            "us_per_step": device_us / steps, "category": kernel_category(event.key)})
    kernels.sort(key=lambda k: -k["us_per_step"])
    busy = sum(k["us_per_step"] for k in kernels)
    categories: dict[str, float] = {}
    for k in kernels:
        categories[k["category"]] = categories.get(k["category"], 0.0) + k["us_per_step"]
    return {
        "system": f"treadle {label}", "steps": steps,
        "wall_us_per_step_profiled": wall * 1e6, "gpu_busy_us_per_step": busy,
        "kernels_per_step": sum(k["calls_per_step"] for k in kernels),
        "by_category_us_per_step": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
        "host_us_per_step": {key: us / steps for key, us in host_us.items()},
        "top_kernels": kernels[:15],
    }


def _host_timer(function: Any, totals: dict[str, float], key: str) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            totals[key] += (time.perf_counter() - start) * 1e6

    return timed


def fill_baseline_ratios(results: Sequence[Measurement], earlier: dict[str, Any]) -> None:
    """Each result's tok/s over the same system at the same batch size in an earlier run's JSON."""
    before = {(r["system"], r["batch_size"]): r["decode_tokens_per_s"] for r in earlier["results"]}
    for r in results:
        if (r.system, r.batch_size) in before:
            r.ratio_vs_baseline = r.decode_tokens_per_s / before[(r.system, r.batch_size)]


def format_table(results: Sequence[Measurement]) -> str:
    hf = {r.batch_size: r for r in results if r.backend is None}
    compiled = {r.batch_size: r for r in results if r.backend == HF_COMPILED}
    with_baseline = any(r.ratio_vs_baseline is not None for r in results)
    header = (f"{'system':<42}{'bs':>4}{'prefill ms':>12}{'step ms':>10}{'tok/s':>10}"
              f"{'roofline ms':>13}{'% roofline':>12}{'x HF':>8}"
              + (f"{'x hf-compiled':>15}" if compiled else "") + (f"{'x baseline':>12}" if with_baseline else ""))
    lines = [header, "-" * len(header)]
    for r in results:
        ref = hf.get(r.batch_size)
        vs_hf = f"{r.decode_tokens_per_s / ref.decode_tokens_per_s:.2f}" if ref else "-"
        line = (f"{r.system:<42}{r.batch_size:>4}{r.prefill_ms:>12.1f}{r.decode_step_ms:>10.2f}"
                f"{r.decode_tokens_per_s:>10.1f}{r.roofline_ms:>13.2f}{100 * r.roofline_fraction:>11.1f}%{vs_hf:>8}")
        if compiled:
            peer = compiled.get(r.batch_size)
            line += f"{r.decode_tokens_per_s / peer.decode_tokens_per_s:>15.2f}" if peer else f"{'-':>15}"
        if with_baseline:
            line += f"{r.ratio_vs_baseline:>12.2f}" if r.ratio_vs_baseline is not None else f"{'-':>12}"
        lines.append(line)
    return "\n".join(lines)


def format_profile(profile: dict[str, Any]) -> str:
    lines = [f"profile: {profile['system']}, bs=1, {profile['steps']} steps: wall "
             f"{profile['wall_us_per_step_profiled']:.0f} us/step, GPU busy {profile['gpu_busy_us_per_step']:.0f} "
             f"us/step, {profile['kernels_per_step']:.0f} kernels/step"]
    for category, us in profile["by_category_us_per_step"].items():
        lines.append(f"  {category:<34}{us:>9.0f} us/step")
    for what, us in profile.get("host_us_per_step", {}).items():
        lines.append(f"  {what:<54}{us:>7.0f} us/step")
    lines.append("  top kernels (us/step, calls/step):")
    for k in profile["top_kernels"][:10]:
        lines.append(f"    {k['us_per_step']:>8.0f} {k['calls_per_step']:>6.0f}  {k['name']}")
    return "\n".join(lines)


def machine_info(device: torch.device) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for package in ("torch", "triton", "flashinfer-python", "transformers"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
    }


def _measurement(system: str, backend: str | None, graph: bool | None, bs: int, prefill_s: float,
                 step_times: list[float], first_tokens: list[int], roofline_s: float) -> Measurement:
    median = statistics.median(step_times)
    return Measurement(
        system=system, backend=backend, cuda_graph=graph, batch_size=bs, prefill_ms=prefill_s * 1e3,
        decode_step_ms=median * 1e3, decode_step_ms_mean=statistics.fmean(step_times) * 1e3,
        decode_tokens_per_s=bs / median, roofline_ms=roofline_s * 1e3, roofline_fraction=roofline_s / median,
        first_tokens=first_tokens,
    )


def _row(r: Measurement) -> str:
    return (f"{r.system} bs={r.batch_size}: prefill {r.prefill_ms:.1f} ms, decode {r.decode_step_ms:.2f} ms/step "
            f"({r.decode_tokens_per_s:.1f} tok/s, {100 * r.roofline_fraction:.1f}% of roofline)")


def _write_config(folder: Path, config: dict[str, Any]) -> str:
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


def _release(runner: Any) -> None:
    """Drop the runner's graphs and free its memory; the caller rebinds its name to the None returned."""
    runner.cuda_graph_runner = None
    runner.model = None
    runner.kv_cache = None
    _free()
    return None


def _variant_overrides(variant: str) -> dict[str, Any]:
    import yaml

    from treadle.plugins.models.fp8 import Fp8LinearMethod

    overrides: dict[str, Any] = {}
    Fp8LinearMethod.small_batch_kernel = "auto"
    for item in filter(None, (part.strip() for part in variant.split(";"))):
        key, _, value = item.partition("=")
        if key == "fp8_small_batch_kernel":
            Fp8LinearMethod.small_batch_kernel = value
        else:
            overrides[key] = yaml.safe_load(value)
    return overrides


def _fp8_choices() -> dict[str, str]:
    from treadle.plugins.models.fp8 import small_batch_choices

    return small_batch_choices()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _default_name(gpu: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return f"one_batch_{slug}_{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle bench one-batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,32", help="comma-separated (default 1,32)")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens per request (default 512)")
    parser.add_argument("--decode-steps", type=int, default=128, help="timed decode steps (default 128)")
    parser.add_argument("--backends", default="torch_native,triton,flashinfer")
    parser.add_argument("--graphs", default="off,on", help="CUDA graphs: off,on (default both)")
    parser.add_argument("--compare", default=None,
                        help="config variants: comma-separated items of ';'-separated KEY=VALUE overrides")
    parser.add_argument("--model", default=None, help="HF model folder (default: Llama-3.1-8B shapes)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of the same kind (smoke test)")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES),
                        help="model shape when no --model is given (default llama-3.1-8b)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks (one GPU each; gloo processes on the CPU); the roofline is per GPU")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--context-length", type=int, default=8192)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers generate")
    parser.add_argument("--no-hf-compiled", action="store_true",
                        help="skip the hf-compiled peer (static cache + torch.compile; GPU only)")
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler summary")
    parser.add_argument("--output", default=None, help="JSON path (default bench/results/one_batch_<gpu>_<date>.json)")
    parser.add_argument("--baseline", help="an earlier run's JSON: adds each row's tok/s ratio to the same system "
                                           "and batch size there (regression tracking)")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
