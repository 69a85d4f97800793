"""One-batch latency: prefill one static batch, then time each decode step, per attention backend.

``treadle bench one-batch [--batch-sizes 1,32] [--input-len 512] [--decode-steps 128]
[--backends torch_native,triton,flashinfer] [--graphs on,off] [--compare SPEC] [--no-hf] [--no-profile]``

The model is Llama-3.1-8B's shape (its config.json written to a temp folder;
``--model`` takes another HF folder) with ``load_format: dummy`` weights in
bfloat16. Each variant (backend x CUDA graphs on/off) gets a fresh ModelRunner
and, per batch size, runs one EXTEND batch of ``--input-len`` random tokens per
request, then ``--decode-steps`` greedy DECODE steps driven on the device
(argmax feeds the next step; no host round trip), each step timed with a
device synchronize — the latency a user of the batch sees (``step ms``; the
host's share of it is ``decode_host_ms`` in the JSON) — then the same steps
again back to back without a synchronize between them (``b2b ms``): the GPU's
time per step, which is what the engine's overlap scheduling leaves.

In the same run:
- the bandwidth roofline: bytes a decode step must read (every weight except
  the embedding table, the embedding rows looked up, and the KV cache of every
  request at the mean decode length) over the device-to-device copy bandwidth
  measured here (a 1 GiB copy, counting bytes read + written);
- HF transformers ``generate`` on the same weights (treadle's copied into
  ``LlamaForCausalLM``), bf16, default dynamic cache, eager: decode per step
  = (time for ``decode-steps`` tokens - time for 1 token) / (steps - 1), the median
  over ``--generate-repeats`` such pairs of calls (default 3);
- ``hf-compiled``: the same with a ``StaticCache`` (``cache_implementation="static"``),
  on which ``generate`` compiles the decode forward with ``torch.compile``
  (mode ``reduce-overhead``: CUDA graphs); its compilation happens in an untimed
  warm-up (skip it with ``--no-hf-compiled``);
- with a GPU and CUDA graphs on, treadle's own ``Engine.generate`` per variant (``one_batch_engine.py``;
  skip it with ``--no-engine``), timed exactly as the HF peers' ``generate`` are, with the scheduler as
  a user runs it (overlap scheduling: the host's work per step hidden behind the GPU's); its rows
  are the like-for-like comparison with ``hf-compiled``;
- with a GPU, a torch.profiler summary of graph decode per backend at bs=1 (``--profile-batch-sizes``: others; top
  kernels, time by kind, and how much of the step the GPU is busy), and one of an
  eager 300-token prefill (GPU busy against wall and the host's launch time: the
  small prefill steps that stall a large decode batch).

A backend may be given tunables: ``--backends flashinfer:use_tensor_cores=false``.
``--compare`` runs every backend once per config variant, as in ``treadle bench offline``: a
comma-separated list of ``;``-separated ``KEY=VALUE`` overrides, e.g.
``--compare "model.quantization=null,model.quantization=fp8"`` (bf16 vs FP8 weights; the roofline
counts each parameter's real bytes, so FP8 weights halve it); ``small_batch_matmul=library`` (or ``triton``)
forces the matmul of decode-sized batches instead of timing it at load (layers/small_batch.py);
a ``TREADLE_*=VALUE`` item sets that environment variable for the variant only (e.g.
``TREADLE_SMALL_BATCH_MATMUL=triton``), for switches read while a runner is built. Where a batch size has several
treadle systems, an ``x first`` column gives each one's tok/s over the first's (FP8 over bf16 above).

Prints a table and writes JSON (``<results folder>/one_batch_<gpu>_<date>.json``
unless ``--output``).

This module builds treadle's model workers and times them; the static batch's prefill and
decode steps are in ``one_batch_steps.py``, the profiler summaries in
``one_batch_profile.py``, the model shapes in ``shapes.py``, the HF peers in
``hf_peers.py``, the roofline and copy bandwidth in ``roofline.py``, and the rows,
table and machine description in ``one_batch_report.py``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch

from treadle.bench.results_folder import results_dir
from treadle.bench.hf_peers import run_hf
from treadle.bench.memory_fit import DoesNotFit, check_fits, memory_need, read_hf_config
from treadle.bench.one_batch_engine import run_engine
from treadle.bench.one_batch_profile import PROFILE_PREFILL_TOKENS, profile_decode, profile_prefill
from treadle.bench.one_batch_report import (Measurement, default_output_name, fill_baseline_ratios,
                                            fill_first_ratios, format_profile, format_row, format_table,
                                            machine_info, measurement)
from treadle.bench.one_batch_steps import decode_step, place_batch, prefill, round_up
from treadle.bench.roofline import free_memory, measure_copy_bandwidth, roofline_seconds, synchronize
from treadle.bench.shapes import SHAPES, TINY, write_config



def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    refuse_what_cannot_run(args)
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

    from treadle.core.distributed.custom_all_reduce import setup_custom_all_reduce
    from treadle.core.distributed.parallel import destroy_tensor_parallel, init_tensor_parallel

    args = _parser().parse_args(argv)
    # HF sees one rank's shard only; an Engine row would start its own tensor-parallel ranks. The profiler runs on
    # every rank (the same steps in lockstep, collectives included): rank 0's summary is printed.
    args.no_hf = args.no_engine = True
    device = _device(args)
    rank_device = torch.device("cuda", rank) if device.type == "cuda" else device
    init_tensor_parallel(rank, tp_size, f"file://{store}", rank_device, timeout_s=1800)
    try:
        setup_custom_all_reduce({"true": True, "false": False}.get(args.custom_all_reduce, "auto"), rank_device, 1, list(range(tp_size)))
        if rank == 0:
            _measure(args, argv)
        else:
            args.output = str(Path(store).parent / f"rank{rank}.json")
            with contextlib.redirect_stdout(io.StringIO()):
                _measure(args, argv)
    finally:
        destroy_tensor_parallel()


def refuse_what_cannot_run(args: argparse.Namespace) -> None:
    """Raise :class:`DoesNotFit` before anything is built when a full model shape is asked of a machine without a
    GPU (unless ``--device cpu`` insists), or when the weights, KV cache and HF peer's copy exceed the free memory."""
    device = _device(args)
    full_shape = not args.tiny and args.model is None
    if full_shape and args.device == "auto" and device.type != "cuda":
        raise DoesNotFit(
            f"one-batch measures {args.shape} shapes on a GPU and torch sees no CUDA device here; on a CPU, "
            "`--tiny --backends torch_native` runs a 2-layer model of the same kind (a smoke test), and "
            "`--device cpu` runs the full shape where the memory allows")
    hf = TINY if args.tiny else SHAPES[args.shape] if args.model is None else read_hf_config(args.model)
    if hf is None:
        return
    max_bs = max(int(b) for b in args.batch_sizes.split(","))
    slots = max_bs * round_up(args.input_len + args.decode_steps + 1, args.page_size)
    # Ranks on the CPU share this host's memory; on GPUs each holds its share on its own device.
    per_device = args.tp if device.type == "cuda" else 1
    # Each --compare variant's runner is released before the next is built: the largest one must fit.
    variants = [v.strip() for v in args.compare.split(",")] if args.compare else [""]
    need = max((memory_need(hf, args.dtype, slots, per_device, with_peer=not args.no_hf and args.tp == 1,
                            fp8="model.quantization=fp8" in variant.replace(" ", "").split(";"))
                for variant in variants), key=lambda n: n.total)
    check_fits(need, torch.device("cuda", 0) if device.type == "cuda" else device,
               f"one-batch with {args.model or args.shape + ' shapes'} in {args.dtype}",
               "try a smaller --shape or --model, --tiny, smaller --batch-sizes, --no-hf (HF transformers' copy of "
               "the weights), or --tp N over more GPUs")


def _device(args: argparse.Namespace) -> torch.device:
    return torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))


def _measure(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    device = _device(args)
    if device.type == "cuda":
        from treadle.core.distributed.parallel import get_tp_rank

        device = torch.device("cuda", get_tp_rank())
    torch.manual_seed(0)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    profile_batch_sizes = [int(b) for b in args.profile_batch_sizes.split(",") if int(b) in batch_sizes]
    prefill_shapes = parse_prefill_shapes(args.prefill_profile, max(batch_sizes), args.input_len)
    graphs = [g == "on" for g in args.graphs.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model or write_config(Path(scratch), TINY if args.tiny else SHAPES[args.shape])
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
                worker = _build_worker(model_dir, backend, options, use_graph, max(batch_sizes), args, device,
                                       variant)
            except Exception as exc:  # a backend missing on this machine is reported, not fatal
                skipped[label] = f"{type(exc).__name__}: {exc}"
                print(f"skipped {label}: {skipped[label]}")
                continue
            if use_graph and worker.cuda_graphs is None:
                skipped[label] = "no CUDA graphs here (CPU, or the backend does not support them)"
                worker = _release(worker)
                continue
            for bs in batch_sizes:
                results.append(run_treadle(worker, label, backend, use_graph, prompts[bs], args, bandwidth))
                print(format_row(results[-1]))
            if use_graph and device.type == "cuda" and not args.no_profile:
                for bs in profile_batch_sizes:
                    profiles[label + ("" if bs == 1 else f" bs={bs}")] = profile_decode(worker, label, prompts[bs])
                for count, length in prefill_shapes:
                    key = f"{label} prefill" + ("" if count == 1 else f" {count}x{length}")
                    profiles[key] = profile_prefill(worker, label, length, prompts=count)
            if not hf_done:
                hf_done = True
                _hf_rows(worker, prompts, args, bandwidth, device, results, skipped)
            worker = _release(worker)
            if use_graph and device.type == "cuda" and not args.no_engine:
                if options:
                    skipped[f"Engine.generate {label}"] = "backend tunables are not applied to an Engine"
                    continue
                for row in run_engine(model_dir, backend, _variant_overrides(variant), label, prompts, args, device,
                                      bandwidth):
                    results.append(row)
                    print(format_row(row))
    if args.baseline:
        fill_baseline_ratios(results, json.loads(Path(args.baseline).read_text()))
    fill_first_ratios(results)
    print()
    print(format_table(results))
    for profile in profiles.values():
        print()
        print(format_profile(profile))
    _write_report(args, argv, device, bandwidth, results, skipped, profiles)
    return 0


def _hf_rows(worker: Any, prompts: dict[int, torch.Tensor], args: argparse.Namespace, bandwidth: float,
             device: torch.device, results: list[Measurement], skipped: dict[str, str]) -> None:
    """HF transformers ``generate`` on the worker's weights, eager (and compiled on CUDA), at every batch size."""
    for compiled in ([False] if args.no_hf_compiled or device.type != "cuda" else [False, True]):
        for bs, batch_prompts in prompts.items():
            try:
                results.append(run_hf(worker.runner, batch_prompts, args, bandwidth, compiled=compiled))
            except Exception as exc:  # a compile failure is reported, not fatal
                skipped[f"hf-compiled bs={bs}"] = f"{type(exc).__name__}: {exc}"[:500]
                print(f"skipped hf-compiled bs={bs}: {skipped[f'hf-compiled bs={bs}']}")
                continue
            print(format_row(results[-1]))


def _write_report(args: argparse.Namespace, argv: Sequence[str] | None, device: torch.device, bandwidth: float,
                  results: list[Measurement], skipped: dict[str, str], profiles: dict[str, Any]) -> None:
    report = {
        "benchmark": "one_batch",
        "command": "treadle bench one-batch " + shlex.join(list(argv if argv is not None else sys.argv[1:])),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(device),
        "model": "tiny" if args.tiny else (args.model or f"{args.shape} shapes, dummy weights"),
        "tp_size": args.tp,
        "all_reduce": _all_reduce_in_use(),
        "dtype": args.dtype,
        "input_len": args.input_len,
        "decode_steps": args.decode_steps,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "results": [asdict(r) for r in results],
        "skipped": skipped,
        "profiles": profiles,
        "small_batch_kernels": _small_batch_choices(),
    }
    output = Path(args.output) if args.output else results_dir() / default_output_name(report["machine"]["gpu"])
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {output}")


# ------------------------------------------------------------------------------------------------
# treadle
# ------------------------------------------------------------------------------------------------


def parse_prefill_shapes(spec: str, max_prompts: int, max_tokens: int) -> list[tuple[int, int]]:
    """``PROMPTSxTOKENS,...`` as (prompts, tokens) pairs; tokens are capped at ``max_tokens`` (the runner's slots
    per request), and more prompts than ``max_prompts`` (its request rows) is an error."""
    shapes: list[tuple[int, int]] = []
    if spec.strip().lower() in ("", "none"):
        return shapes
    for item in spec.split(","):
        try:
            count, length = (int(part) for part in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"--prefill-profile item '{item}' must look like PROMPTSxTOKENS, e.g. 7x292") from None
        if not 1 <= count <= max_prompts or length < 1:
            raise SystemExit(f"--prefill-profile {item}: 1 to {max_prompts} prompts (the largest batch size) of "
                             "at least one token")
        shapes.append((count, min(length, max_tokens)))
    return shapes


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


def _build_worker(model_dir: str, backend: str, options: dict[str, Any], use_graph: bool, max_bs: int,
                  args: argparse.Namespace, device: torch.device, variant: str = "") -> Any:
    """A ModelWorker whose backend gets ``options`` set before any CUDA graph is captured; ``variant``
    is ``KEY=VALUE;...`` config overrides (plus ``small_batch_matmul``)."""
    from treadle.core.config import load_config
    from treadle.core.execution.worker import ModelWorker
    from treadle.core.registry import build_registry

    slots_per_request = round_up(args.input_len + args.decode_steps + 1, args.page_size)
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
    worker = ModelWorker(config, build_registry())  # graphs off: the tunables go in before the capture
    backend_object = worker.runner.attn_backend
    for attr, value in options.items():
        if not hasattr(backend_object, attr):
            raise ValueError(f"attention backend '{backend}' has no tunable '{attr}'")
        setattr(backend_object, attr, value)
    if use_graph and device.type == "cuda" and getattr(backend_object, "supports_cuda_graph", False):
        worker.capture_graphs(force=True)  # decode graphs, and prefill pieces up to the resolved piecewise size
    return worker


def run_treadle(worker: Any, label: str, backend: str, use_graph: bool, prompts: torch.Tensor,
                args: argparse.Namespace, bandwidth: float) -> Measurement:
    bs, input_len = prompts.shape
    runner = worker.runner
    batch = place_batch(worker, bs, input_len + args.decode_steps + 1)
    device = runner.device
    for _ in range(args.warmup):  # the warm-up pass also compiles kernels
        next_ids = prefill(worker, batch, prompts)
        for step in range(min(4, args.decode_steps)):
            next_ids = decode_step(worker, batch, next_ids, input_len + step + 1)
    synchronize(device)
    start = time.perf_counter()
    next_ids = prefill(worker, batch, prompts)
    synchronize(device)
    prefill_s = time.perf_counter() - start
    step_times, host_times, first_tokens = [], [], [int(next_ids[0])]
    for step in range(args.decode_steps):
        start = time.perf_counter()
        next_ids = decode_step(worker, batch, next_ids, input_len + step + 1)
        host_times.append(time.perf_counter() - start)
        synchronize(device)
        step_times.append(time.perf_counter() - start)
        if step < 15:
            first_tokens.append(int(next_ids[0]))
    # The same steps again without waiting for each: the host builds and launches the next step while the GPU
    # runs this one, as the engine's overlap scheduling does, so this is the GPU's time per step.
    start = time.perf_counter()
    for step in range(args.decode_steps):
        next_ids = decode_step(worker, batch, next_ids, input_len + step + 1)
    synchronize(device)
    back_to_back_s = (time.perf_counter() - start) / args.decode_steps
    return measurement(f"treadle {label}", backend, use_graph, bs, prefill_s, step_times, first_tokens,
                       roofline_seconds(runner.model, runner, bs, input_len, args.decode_steps, bandwidth),
                       host_times, back_to_back_s)


def _release(worker: Any) -> None:
    """Drop the worker's graphs and free its memory; the caller rebinds its name to the None returned."""
    worker.release_graphs()
    worker.runner.model = None
    worker.runner.kv_cache = None
    worker.context = None  # it holds the KV cache too
    free_memory()
    return None


_variant_env: dict[str, str | None] = {}


def _variant_overrides(variant: str) -> dict[str, Any]:
    import yaml

    from treadle.layers import small_batch

    overrides: dict[str, Any] = {}
    small_batch.set_mode(None)
    for name, original in _variant_env.items():  # undo the previous variant's environment
        if original is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = original
    _variant_env.clear()
    for item in filter(None, (part.strip() for part in variant.split(";"))):
        key, _, value = item.partition("=")
        if key == "small_batch_matmul":
            small_batch.set_mode(value)
        elif key.startswith("TREADLE_"):
            _variant_env.setdefault(key, os.environ.get(key))
            os.environ[key] = value
        else:
            overrides[key] = yaml.safe_load(value)
    return overrides


def _all_reduce_in_use() -> str:
    from treadle.core.distributed.parallel import get_tp_group

    fast = get_tp_group().custom_all_reduce
    return fast.describe() if fast is not None else "nccl"


def _small_batch_choices() -> dict[str, str]:
    from treadle.layers.small_batch import choices

    return choices()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle bench one-batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,32", help="comma-separated (default 1,32)")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens per request (default 512)")
    parser.add_argument("--decode-steps", type=int, default=128, help="timed decode steps (default 128)")
    parser.add_argument("--backends", default="torch_native,triton,flashinfer,flashinfer_triton")
    parser.add_argument("--graphs", default="off,on", help="CUDA graphs: off,on (default both)")
    parser.add_argument("--compare", default=None,
                        help="config variants: comma-separated items of ';'-separated KEY=VALUE overrides")
    parser.add_argument("--model", default=None, help="HF model folder (default: Llama-3.1-8B shapes)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of the same kind (smoke test)")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES),
                        help="model shape when no --model is given (default llama-3.1-8b)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks (one GPU each; gloo processes on the CPU); the roofline is per GPU")
    parser.add_argument("--custom-all-reduce", default="auto", choices=["auto", "true", "false"],
                        help="with --tp: parallel.custom_all_reduce (peer-to-peer all-reduce for small messages)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--context-length", type=int, default=8192)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers generate")
    parser.add_argument("--no-hf-compiled", action="store_true",
                        help="skip the hf-compiled peer (static cache + torch.compile; GPU only)")
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler summary")
    parser.add_argument("--generate-repeats", type=int, default=3, metavar="N",
                        help="pairs of whole generate calls (1 token, then --decode-steps) behind each HF and "
                             "Engine.generate row; the row takes the median step (default 3)")
    parser.add_argument("--no-engine", action="store_true",
                        help="skip the Engine.generate rows (GPU, graphs on: treadle timed as the HF peers are)")
    parser.add_argument("--profile-batch-sizes", default="1", metavar="BS,...",
                        help="decode batch sizes the profiler summarizes (default 1; each must be in --batch-sizes)")
    parser.add_argument("--prefill-profile", default=f"1x{PROFILE_PREFILL_TOKENS}", metavar="PROMPTSxTOKENS,...",
                        help="prefill steps the profile times (default 1x300, capped at --input-len tokens); "
                             "at most the largest batch size of prompts each; none: no prefill profile")
    parser.add_argument("--output", default=None, help="JSON path (default <results folder>/one_batch_<gpu>_<date>.json)")
    parser.add_argument("--baseline", help="an earlier run's JSON: adds each row's tok/s ratio to the same system "
                                           "and batch size there (regression tracking)")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
