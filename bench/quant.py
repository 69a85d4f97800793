"""W4A16 against bf16 on Llama-3.1-8B's shapes (dummy weights), in one run: ``python -m treadle.bench.quant``.

Writes the two shapes' config.json (bf16, and the same model with an llm-compressor W4A16 ``quantization_config``:
compressed-tensors pack-quantized, symmetric, groups of 128; ``--format awq`` uses AutoAWQ's, with zero points) and
runs, with the same settings for both:

- ``treadle bench one-batch`` (triton attention, CUDA graphs, ``--batch-sizes``, default 1,32): the decode step, its
  tok/s over bf16 (``x first``) and its fraction of its own roofline, whose bytes count each parameter as stored
  (packed int4 weights, their scales, the 16-bit lm_head) plus the KV cache;
- ``treadle bench offline``'s 1000-request ``random`` workload (docs/benchmarks.md); ``--runs`` picks either.

``--shape mixtral-8x7b`` runs the offline workload on Mixtral-8x7B's W4A16 shape alone (--format w4a16; its
experts packed, through the integer fused-MoE kernels): bf16 does not fit one H100.

Then prints the ratios against the targets of docs/quantization.md (bs=1 >= 2.4x bf16 and >= 80% of the W4A16
roofline; bs=32 >= 1.6x; offline >= 1.0x) and writes the JSON of both runs under ``--out``.

``--profile`` adds one_batch's torch.profiler window (20 decode steps, CUDA graphs) at every ``--batch-sizes`` for
both models and prints them side by side (:func:`profile_table`): per step, the GPU's time in kernels, the idle
time between a step's kernels, the kernels by kind, and the top kernels of each.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from treadle.bench.shapes import MODEL_SHAPES, write_config

TARGETS = {1: 2.4, 32: 1.6}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.shape != "llama-3.1-8b":
        return _quantized_only(args)
    out = Path(args.out)
    folders = {}
    for name in ("llama-3.1-8b", f"llama-3.1-8b-{args.format}"):
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        folders[name] = write_config(folder, MODEL_SHAPES[name])
    bf16, quantized = folders.values()
    compare = f"model.path={bf16},model.path={quantized}"
    from treadle.bench import one_batch

    runs = set(args.runs.split(","))
    if args.precompile:
        from treadle.bench.quant_sweep import precompile_loader

        precompile_loader(args.precompile, zeros=args.format == "awq")
    one_batch_json = out / "one_batch_quant.json"
    if "one-batch" in runs:
        quick = ["--no-engine", "--decode-steps", "32"] if args.quick else []
        profile = (["--profile-batch-sizes", args.batch_sizes, "--prefill-profile", "none"] if args.profile
                   else ["--no-profile"])
        one_batch.main(["--model", bf16, "--batch-sizes", args.batch_sizes, "--backends", "triton", "--graphs", "on",
                        "--compare", compare, "--no-hf", *profile, *quick, "--output", str(one_batch_json)])
    offline_json = out / "offline_quant.json"
    if "offline" in runs:
        from treadle.bench import offline_throughput

        # Each --offline-variant runs both models once more with its overrides, after the defaults.
        variants = ",".join(f"model.path={model};{overrides}" for overrides in args.offline_variant
                            for model in (bf16, quantized))
        offline_throughput.main(["--workload", "random", "--num-prompts", str(args.num_prompts), "--input-len",
                                 "16:600", "--output-len", "16:400", "--set", f"model.path={bf16}", "--set",
                                 "model.load_format=dummy", "--dtype", "bfloat16", "--device", "cuda",
                                 "--no-progress", "--compare", ",".join(filter(None, (compare, variants))),
                                 "--output", str(offline_json)])
    one_batch_report = json.loads(one_batch_json.read_text()) if "one-batch" in runs else {"results": []}
    print()
    print(summary(one_batch_report, json.loads(offline_json.read_text()) if "offline" in runs else None, quantized))
    print(chosen_kernels(MODEL_SHAPES["llama-3.1-8b"]["num_hidden_layers"]))
    if args.profile:
        print(profile_table(one_batch_report.get("profiles", {}), quantized))
    return 0


def profile_table(profiles: dict, quantized: str, top: int = 14) -> str:
    """one_batch's decode profiles (``profiles``: its JSON's, keyed by run) of bf16 and of the ``quantized`` model
    side by side per batch size: microseconds per step in kernels, in the union of the kernels (programmatic
    dependent launch overlaps them), idle between a step's kernels, per kind of kernel, the host's time in the
    worker's methods; then the kernels the GPU idled longest just before, and the ``top`` kernels of each
    (microseconds and calls per step)."""
    by_bs: dict[int, dict[str, dict]] = {}
    for profile in profiles.values():
        what = profile.get("what", "")
        if what.startswith("bs=") and what.endswith(" decode"):
            model = "w4a16" if quantized in profile["system"] else "bf16"
            by_bs.setdefault(int(what.split()[0][3:]), {})[model] = profile
    lines = []
    for bs, pair in sorted(by_bs.items()):
        base, quant = pair.get("bf16", {}), pair.get("w4a16", {})
        lines += ["", f"{f'decode bs={bs}, us per step':<44}{'bf16':>9}{'w4a16':>9}{'w4a16-bf16':>12}"]
        rows = [("wall (profiled)", "wall_us_per_step_profiled"), ("GPU in kernels (sum)", "gpu_busy_us_per_step"),
                ("GPU in kernels (union)", "gpu_union_us_per_step"),
                ("GPU idle between a step's kernels", "gpu_idle_in_step_us_per_step"),
                ("kernels per step", "kernels_per_step")]
        kinds = list(dict.fromkeys(kind for p in (base, quant) for kind in p.get("by_category_us_per_step", {})))
        host = list(dict.fromkeys(what for p in (base, quant) for what in p.get("host_us_per_step", {})))
        for label, key in rows + [(f"  {kind}", kind) for kind in kinds] + [(f"  {what[:42]}", what) for what in host]:
            a, b = (_profile_value(p, key) for p in (base, quant))
            lines.append(f"{label:<44}{_cell(a)}{_cell(b)}{_cell(None if a is None or b is None else b - a, 12)}")
        lines.append(f"  idle just before {'bf16 (us, name)':<43}| w4a16")
        for left, right in zip(*(_padded(list(p.get("gpu_idle_before_us_per_step", {}).items())[:5], 5)
                                 for p in (base, quant))):
            if left is not None or right is not None:
                lines.append(f"  {_idle_cell(left):<60}| {_idle_cell(right)}")
        lines.append(f"  top kernels {'bf16 (us, calls, name)':<48}| w4a16")
        for left, right in zip(*(_padded(p.get("top_kernels", [])[:top], top) for p in (base, quant))):
            if left is not None or right is not None:
                lines.append(f"  {_kernel_cell(left):<60}| {_kernel_cell(right)}")
    return "\n".join(lines)


def _profile_value(profile: dict, key: str) -> float | None:
    """A profile's top-level number ``key``, else its kernel kind's or host method's time of that name."""
    return profile.get(key, profile.get("by_category_us_per_step", {}).get(
        key, profile.get("host_us_per_step", {}).get(key)))


def _cell(value: float | None, width: int = 9) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.0f}"


def _padded(items: list, size: int) -> list:
    return list(items) + [None] * (size - len(items))


def _idle_cell(item: tuple[str, float] | None) -> str:
    return "" if item is None else f"{item[1]:>6.0f}        {item[0][:44]}"


def _kernel_cell(kernel: dict | None) -> str:
    if kernel is None:
        return ""
    return f"{kernel['us_per_step']:>6.0f} {kernel['calls_per_step']:>4.0f}  {kernel['name'][:44]}"


def chosen_kernels(layers: int = 0) -> str:
    """What each W4A16 weight shape the one-batch run loaded (in this process) runs, as the loader timed it (with its
    time per call); given the model's ``layers``, the kept launches' times summed over the shapes, per decode step."""
    from treadle.layers.int_kernel_choice import chosen_plans, kept_seconds

    timed = kept_seconds()
    plans = {shape: plan for shape, plan in chosen_plans().items() if plan is not None}

    def took(n: int, k: int, rows: int) -> str:
        return f" ({timed[n, k, rows] * 1e6:.1f} us)" if (n, k, rows) in timed else ""

    lines = [f"{n} x {k}: 1 row {plan.gemv}{took(n, k, 1)}\n  16 rows {plan.small}{took(n, k, 16)}\n"
             f"  32 rows {plan.medium}{took(n, k, 32)}\n  64 rows {plan.large}{took(n, k, 64)}\n"
             + "".join(f"  up to {most} rows {tiles}{took(n, k, most)}\n" for most, tiles in plan.wide)
             + f"  the tl.dot kernels up to {max([plan.dot_max_rows, *(most for most, _ in plan.wide)])} rows, "
             f"then dequantize + cuBLAS ({plan.dequant})"
             for (n, k), plan in plans.items()]
    for rows in (1, 16, 32, 64, 128, 256, 512, 1024):
        # (at 512 rows the loader also timed the dequantization alone: a wide_mma bucket's timing or none)
        if layers and plans and all((n, k, rows) in timed and (rows != 512 or any(most == 512 for most, _ in
                                                                                    plan.wide))
                                    for (n, k), plan in plans.items()):
            total = sum(timed[n, k, rows] for n, k in plans) * layers
            lines.append(f"the kept launches at {rows} row{'s' if rows > 1 else ''}, as the loader timed them: "
                         f"{total * 1e3:.2f} ms per decode step ({layers} layers)")
    return "\n".join(["kernels chosen at load:", *lines]) if lines else ""


def _quantized_only(args: argparse.Namespace) -> int:
    """A shape that does not fit one GPU in bf16 (``--shape mixtral-8x7b``: 93 GB): the offline run of its W4A16
    twin alone (its experts packed, through the integer fused-MoE kernels)."""
    from treadle.bench import offline_throughput

    name = f"{args.shape}-{args.format}"
    folder = Path(args.out) / name
    folder.mkdir(parents=True, exist_ok=True)
    model = write_config(folder, MODEL_SHAPES[name])
    output = Path(args.out) / f"offline_{name}.json"
    offline_throughput.main(["--workload", "random", "--num-prompts", str(args.num_prompts), "--input-len",
                             "16:600", "--output-len", "16:400", "--set", f"model.path={model}", "--set",
                             "model.load_format=dummy", "--dtype", "bfloat16", "--device", "cuda", "--no-progress",
                             "--output", str(output)])
    system = json.loads(output.read_text())["systems"][-1]
    print(f"\n{name} offline: {system['output_throughput_tok_s']:.0f} out tok/s ({args.num_prompts} requests)")
    return 0


def summary(one_batch: dict, offline: dict | None, quantized: str) -> str:
    """The W4A16 rows against their targets."""
    lines = [f"{'':<28}{'bf16 ms':>9}{'w4a16 ms':>10}{'speed-up':>10}{'target':>8}{'roofline':>10}"]
    rows = [r for r in one_batch["results"] if r["system"].startswith("treadle")]
    for bs in sorted({r["batch_size"] for r in rows}):
        pair = [r for r in rows if r["batch_size"] == bs and not r.get("engine")]
        if len(pair) < 2:
            continue
        base, quant = pair[0], next((r for r in pair if quantized in r["system"]), pair[-1])
        speedup = base["decode_step_ms"] / quant["decode_step_ms"]
        lines.append(f"{f'decode bs={bs}':<28}{base['decode_step_ms']:>9.2f}{quant['decode_step_ms']:>10.2f}"
                     f"{speedup:>9.2f}x{TARGETS.get(bs, 0):>7.1f}x{quant['roofline_fraction']:>9.0%}")
    if offline is not None:
        systems = offline["systems"]
        for first in range(0, len(systems) - 1, 2):  # the defaults, then each --offline-variant's pair
            base, quant = (systems[first + i]["output_throughput_tok_s"] for i in (0, 1))
            label = "offline out tok/s" + (f" ({first // 2})" if first else "")
            lines.append(f"{label:<28}{base:>9.0f}{quant:>10.0f}{quant / base:>9.2f}x{1.0:>7.1f}x")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m treadle.bench.quant", description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", choices=["w4a16", "awq"], default="w4a16",
                        help="w4a16: compressed-tensors symmetric (no zero points); awq: AutoAWQ with zero points")
    parser.add_argument("--shape", choices=["llama-3.1-8b", "mixtral-8x7b"], default="llama-3.1-8b",
                        help="mixtral-8x7b: the W4A16 offline run alone (bf16 does not fit one H100)")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--runs", default="one-batch,offline",
                        help="one-batch (decode steps at --batch-sizes), offline (the 1000-request run), or both")
    parser.add_argument("--quick", action="store_true",
                        help="one-batch: the GPU's time per step alone (no Engine.generate runs), 32 decode steps")
    parser.add_argument("--profile", action="store_true",
                        help="one-batch: profile 20 decode steps of each model at every --batch-sizes and print "
                             "their kernels side by side")
    parser.add_argument("--precompile", type=int, default=0, metavar="JOBS",
                        help="first compile every launch the loader times, in JOBS processes at once (on a fresh "
                             "machine the loader would compile them one by one)")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--offline-variant", action="append", default=[], metavar="KEY=VALUE[;KEY=VALUE]",
                        help="offline: both models once more with these overrides (e.g. "
                             "scheduler.max_running_requests=1024); repeatable, numbered in the summary")
    parser.add_argument("--out", default="/tmp/treadle-quant", help="folder for the shapes and the JSON")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
