"""LoRA adapters' cost on a GPU: the kernels against the base projections, and the engine with adapters against the
base model, in one run.

``treadle bench lora [--part kernels|gemv|engine|all] [--backend triton] [--rank 16] [--num-prompts 1000]
[--spread 16] [--set KEY=VALUE ...] [--sweep [--choice FIELD=N,...] [--sizes 1,32]] [--output PATH]``

- ``kernels`` (bench/lora_kernels.py): Llama-3.1-8B's projections, a rank-``rank`` adapter on all seven: the 32
  layers' deltas (one shrink and one expand per fused layer, as the engine runs them; and per projection, the
  earlier form, for comparison) against their base matmuls, from CUDA graphs, at bs=1 decode with one adapter,
  bs=32 with 32 adapters, bs=256, 1024 decode tokens, 4096- and 8192-token prefills over 16; for the ``triton``
  backend also with the dense form (kernels/lora_dense.py) forced on and off. With ``--sweep``: the ``triton``
  backend's kernel choices (kernels/lora_choice.py, ``dense_above`` among them) side by side per size (``--sizes
  1,32``: those sizes only), each as ``(base + LoRA) / base``. ``--slots N``: resident adapter slots (default the
  cases' largest adapter count, 32; the engine part's ``max_loras_per_batch`` is 32), which the dense form's work
  grows with.
- ``gemv`` (bench/lora_gemv.py): the 32 layers through the engine's own layers and small-batch kernels (the Triton
  GEMVs and tiles chosen by timing, their SiLU·mul and add + RMSNorm epilogues), base against a rank-``rank``
  adapter on all seven projections unfused (``fuse_gemv=0``) and split around the matmul (kernels/lora_fused.py), at
  bs=1 with one adapter and bs=32 with 32, then bs=32 with every layer on cuBLAS. Not part of ``all``.
- ``engine`` (bench/lora_engine.py): ``load_format: dummy`` weights of the shape (``--shape``), 32 random PEFT
  adapters written to a temporary folder (``--adapters-dir`` keeps them), then the base model alone and the model
  with the adapters: the offline workload (``treadle bench offline``'s 1000-request ``random`` one: inputs
  16-600, outputs 16-400 tokens) spread over ``--spread`` adapters (target: >= 0.85x the base's throughput),
  bs=1 decode with an adapter (<= 1.10x the base step) and bs=32 with 32 different adapters (<= 1.25x);
  ``--engine-kernels dense_above=1048576`` (repeatable) runs the adapters' side again with that
  ``TREADLE_LORA_KERNELS`` text, against the same base run (an A/B of a kernel choice end to end). It needs
  the engine's LoRA side (``lora.*`` config, ``Engine.generate(..., lora_path=...)``); without it the part says
  so and is skipped.

Prints a table and writes JSON (``<results folder>/lora_<gpu>_<date>.json`` unless ``--output``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from treadle.bench.results_folder import results_dir

TARGETS = {"offline_ratio": (">=", 0.85), "bs1_step_ratio": ("<=", 1.10), "bs32_step_ratio": ("<=", 1.25)}
NUM_ADAPTERS = 32


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("error: treadle bench lora times CUDA kernels and graphs; no CUDA device here", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "benchmark": "lora", "command": "treadle bench lora " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "backend": args.backend, "rank": args.rank,
    }
    if args.part in ("kernels", "all") and args.sweep:
        from treadle.bench.lora_kernels import SWEEP_CASES, SWEEP_CHOICES, run_kernel_sweep
        from treadle.kernels.lora_choice import choice_fields

        choices = (SWEEP_CHOICES[0], *(choice_fields(text) for text in args.choice)) if args.choice else SWEEP_CHOICES
        sizes = {int(size) for size in args.sizes.split(",")} if args.sizes else None
        cases = tuple(case for case in SWEEP_CASES if sizes is None or case.tokens in sizes)
        report["kernel_sweep"] = run_kernel_sweep(args.rank, choices, cases, slots=args.slots)
        print(format_sweep_table(report["kernel_sweep"]), flush=True)
    elif args.part == "gemv":
        from treadle.bench.lora_gemv import format_gemv_table, run_gemv_cases

        report["gemv"] = run_gemv_cases(args.rank, slots=args.slots or NUM_ADAPTERS)
        print(format_gemv_table(report["gemv"]), flush=True)
    elif args.part in ("kernels", "all"):
        from treadle.bench.lora_kernels import run_kernel_cases

        report["kernels"] = run_kernel_cases(args.backend, args.rank, slots=args.slots)
        print(format_kernel_table(report["kernels"]), flush=True)
        torch.cuda.empty_cache()  # the 32 layers' weights, before the engines load theirs
    if args.part in ("engine", "all"):
        report["end_to_end"] = _engine_part(args)
        print(format_engine_table(report["end_to_end"]), flush=True)
    gpu = torch.cuda.get_device_name().lower().replace(" ", "-")
    path = Path(args.output) if args.output else results_dir() / f"lora_{gpu}_{dt.date.today():%Y%m%d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def format_kernel_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"LoRA kernels ({rows[0]['backend']}, rank {rows[0]['rank']}, 7 projections x 32 layers) vs base matmuls"
             if rows else "LoRA kernels: no cases",
             f"{'case':34s} {'base ms':>9s} {'lora ms':>9s} {'both ms':>9s} {'ratio':>7s} {'per-proj ms':>11s}"
             f" {'dense ratio':>11s} {'no-dense':>8s}"]
    for row in rows:
        per_projection = row.get("lora_per_projection_ms")
        forms = row.get("forms", {})
        lines.append(f"{row['case']:34s} {row['base_ms']:9.3f} {row['lora_ms']:9.3f} {row['base_plus_lora_ms']:9.3f} "
                     f"{row['ratio']:7.3f} " + (f"{per_projection:11.3f}" if per_projection is not None else " " * 11)
                     + "".join(f" {forms[form]['ratio']:{width}.3f}" for form, width in (("dense", 11), ("no_dense", 8))
                               if form in forms))
    return "\n".join(lines)


def format_sweep_table(rows: list[dict[str, Any]]) -> str:
    """Per case, each kernel choice's ``(base + LoRA) / base`` and its change against the case's first row (the
    default)."""
    lines = ["LoRA kernel choices (triton, 7 projections x 32 layers): (base + LoRA) / base per decode size",
             f"{'case':22s} {'choice':40s} {'base ms':>8s} {'lora ms':>8s} {'ratio':>7s} {'vs default':>10s}"]
    first: dict[str, float] = {}
    best: dict[str, dict[str, Any]] = {}
    for row in rows:
        default = first.setdefault(row["case"], row["ratio"])
        if row["case"] not in best or row["ratio"] < best[row["case"]]["ratio"]:
            best[row["case"]] = row
        lines.append(f"{row['case']:22s} {row['choice']:40s} {row['base_ms']:8.3f} {row['lora_ms']:8.3f} "
                     f"{row['ratio']:7.3f} {row['ratio'] - default:+10.3f}")
    lines += ["best per case:"] + [f"{case:22s} {row['choice']:40s} {row['ratio']:7.3f}" for case, row in best.items()]
    return "\n".join(lines)


def format_engine_table(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return f"end to end: skipped: {result['skipped']}"
    base, lora = result["base"], result["lora"]
    rows = [("offline workload (output tok/s)", base["offline_output_tok_s"], lora["offline_output_tok_s"],
             "offline_ratio"),
            ("bs=1 decode step (ms), one adapter", base["bs1_step_ms"], lora["bs1_step_ms"], "bs1_step_ratio"),
            ("bs=32 decode step (ms), 32 adapters", base["bs32_step_ms"], lora["bs32_step_ms"], "bs32_step_ratio")]
    lines = [f"end to end: base model vs adapters (offline spread over {result['spread_over_adapters']})",
             f"{'metric':38s} {'base':>10s} {'lora':>10s} {'ratio':>7s}  target"]
    for label, base_value, lora_value, key in rows:
        sign, bound = TARGETS[key]
        met = result[key] >= bound if sign == ">=" else result[key] <= bound
        lines.append(f"{label:38s} {base_value:10.2f} {lora_value:10.2f} {result[key]:7.3f}  {sign} {bound:.2f} "
                     f"{'ok' if met else 'MISSED'}")
    for variant, values in result.get("kernel_variants", {}).items():
        lines.append(f"  with TREADLE_LORA_KERNELS={variant}: offline {values['offline_ratio']:.3f}x, bs=1 "
                     f"{values['bs1_step_ratio']:.3f}x, bs=32 {values['bs32_step_ratio']:.3f}x")
    return "\n".join(lines)


def _engine_part(args: argparse.Namespace) -> dict[str, Any]:
    from treadle.bench.lora_engine import lora_api_missing, run_engine_side, write_adapters
    from treadle.bench.shapes import MODEL_SHAPES, write_config
    from treadle.bench.workloads import build_workload, parse_len_range, usable_token_ids

    missing = lora_api_missing()
    if missing:
        print(f"end to end: skipped: {missing}", file=sys.stderr)
        return {"skipped": missing}
    shape = MODEL_SHAPES[args.shape]
    work = Path(args.adapters_dir) if args.adapters_dir else Path(tempfile.mkdtemp(prefix="treadle-lora-bench-"))
    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    write_config(model_dir, shape)
    print(f"writing {NUM_ADAPTERS} rank-{args.rank} adapters under {work} ...", flush=True)
    started = time.perf_counter()
    paths = write_adapters(work / "adapters", shape, NUM_ADAPTERS, args.rank, device="cuda")
    written_s = time.perf_counter() - started
    base = {"model.path": str(model_dir), "model.load_format": "dummy", "model.dtype": "bfloat16",
            "model.device": "cuda", **dict(item.split("=", 1) for item in args.set)}
    lora = {"lora.paths": paths, "lora.max_loras_per_batch": NUM_ADAPTERS, "lora.max_rank": args.rank,
            "lora.backend": args.backend}
    workload = build_workload("random", args.num_prompts, usable_token_ids(shape["vocab_size"]), seed=args.seed,
                              input_len=parse_len_range(args.input_len), output_len=parse_len_range(args.output_len))
    result = run_engine_side(base, lora, list(paths), workload, args.spread, args.repeats, args.decode_tokens,
                             tuple(args.engine_kernels))
    result["workload"] = workload.summary()
    result["adapters_written_s"] = written_s
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle bench lora",
                                     description="LoRA adapters' cost: kernels vs base projections, engine vs base.")
    parser.add_argument("--part", choices=["kernels", "gemv", "engine", "all"], default="all")
    parser.add_argument("--backend", default="triton", help="the lora_backends plugin to time")
    parser.add_argument("--rank", type=int, default=16, help="every adapter's rank (and lora.max_rank)")
    parser.add_argument("--shape", default="llama-3.1-8b", help="engine part: a bench/shapes.py MODEL_SHAPES entry")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", default="16:600")
    parser.add_argument("--output-len", default="16:400")
    parser.add_argument("--seed", type=int, default=0, help="workload RNG seed")
    parser.add_argument("--spread", type=int, default=16, help="offline requests go round-robin to this many adapters")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of calls per decode-step measurement")
    parser.add_argument("--decode-tokens", type=int, default=64, help="new tokens of a decode-step call")
    parser.add_argument("--adapters-dir", help="where to write the model config and adapters (default: a temp folder)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="engine part: override a config key of both engines (repeatable)")
    parser.add_argument("--sweep", action="store_true",
                        help="kernels part: time the triton backend's kernel choices (kernels/lora_choice.py) "
                             "against its default per decode size, instead of the fixed cases")
    parser.add_argument("--choice", action="append", default=[], metavar="FIELD=N,...",
                        help="with --sweep: a LoRAKernelChoice to time instead of the built-in list (repeatable), "
                             "e.g. go_ahead=0 or shrink_tile=16384,busy_programs=1024")
    parser.add_argument("--sizes", metavar="N,N,...",
                        help="with --sweep: only these sizes in tokens (of 1, 8, 32, 64, 128, 256, 512, 1024, 4096)")
    parser.add_argument("--slots", type=int,
                        help="kernels part: resident adapter slots (default: the cases' largest adapter count)")
    parser.add_argument("--engine-kernels", action="append", default=[], metavar="FIELD=N,...",
                        help="engine part: run the adapters' side once more with this TREADLE_LORA_KERNELS text "
                             "(repeatable), e.g. dense_above=1048576 for the engine without the dense form")
    parser.add_argument("--output", help="JSON path (default <results folder>/lora_<gpu>_<date>.json)")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
