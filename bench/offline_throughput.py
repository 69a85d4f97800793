"""Offline throughput: one synthetic workload through several systems in one run, compared.

``treadle bench offline [--workload random|shared-prefix] [--compare SPEC] [--backends A,B] [--json-schema FILE]``

Systems are treadle configurations (the base config from ``--config``/``--set``
plus one override set per variant) and, with ``hf`` in ``--compare``, HF
transformers ``generate``. Every system gets the same prompts and must produce
the same number of tokens (treadle with ``ignore_eos``, HF with
``min_new_tokens``), greedily. Each system is warmed up first (not timed).

The treadle side (timing, the ``--json-schema`` A/B) is in ``offline_treadle.py``, the HF
baseline (how HF is batched) in ``offline_hf.py``, the result type, ratios, table and JSON report in
``offline_results.py``; this module parses the command line and runs the systems in order.

Prints a table and writes JSON (``<results folder>/offline_<workload>_<date>.json``
unless ``--output``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from treadle.bench.results_folder import results_dir
from treadle.bench.offline_hf import HF, hf_target, run_hf
from treadle.bench.offline_results import (SystemResult, build_report, fill_baseline_ratios, fill_ratios,
                                           format_table, progress_line)
from treadle.bench.offline_treadle import Variant, make_engine, run_json_schema_ab, run_treadle
from treadle.bench.step_meter import format_profile
from treadle.bench.workloads import WORKLOAD_NAMES, Workload, build_workload, parse_len_range, usable_token_ids
from treadle.core.config import ConfigError, load_config

_DEFAULT_OUTPUT_LEN = {"random": "16:128", "shared-prefix": "16:64"}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        variants, with_hf = parse_variants(args.compare, args.backends)
        overrides = base_overrides(args)
        configs = [load_config(args.config, overrides + v.overrides) for v in variants]
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    progress = not args.no_progress
    if args.threads:
        torch.set_num_threads(args.threads)

    json_schema = Path(args.json_schema).read_text() if args.json_schema else None
    if json_schema is not None and with_hf:
        print("error: --json-schema compares treadle with and without a constraint; drop 'hf' from --compare",
              file=sys.stderr)
        return 2
    results: list[SystemResult] = []
    workload: Workload | None = None
    target: dict[str, Any] = {}
    for variant, config in zip(variants, configs):
        engine = make_engine(config)
        if workload is None:
            workload = _workload(args, engine)
            print(_describe(workload), flush=True)
            target = hf_target(engine, config)
        if json_schema is not None:
            results.extend(run_json_schema_ab(engine, workload, variant, config, args, progress, json_schema))
        else:
            results.append(run_treadle(engine, workload, variant, config, args.warmup_prompts, progress,
                                       args.profile_steps, step_trace=args.step_trace))
            print(progress_line(results[-1]), flush=True)
        if "profile" in results[-1].extra:
            print(format_profile(variant.label, results[-1].extra["profile"]), flush=True)
        engine.shutdown()
        del engine
        _free_memory()
    assert workload is not None
    if with_hf:
        results.append(run_hf(workload, args.hf_batch_size, target, args.warmup_prompts, progress))
        _free_memory()

    fill_ratios(results)
    if args.baseline:
        fill_baseline_ratios(results, workload, Path(args.baseline))
    print(format_table(results))
    report = build_report(args, argv, workload, results)
    path = Path(args.output) if args.output else results_dir() / _default_name(workload.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def parse_variants(compare: str | None, backends: str | None) -> tuple[list[Variant], bool]:
    """``--compare``/``--backends`` → (treadle variants, whether HF runs too).

    ``--compare`` is a comma-separated list of items; an item is ``hf`` or a
    ``;``-separated set of ``KEY=VALUE`` overrides. ``--backends a,b`` is
    shorthand for ``--compare attention.backend=a,attention.backend=b``.
    With no treadle variant the base config runs alone (labelled ``treadle``).
    """
    items = [item.strip() for item in (compare or "").split(",") if item.strip()]
    with_hf = any(item.lower() == HF for item in items)
    variants = [_variant(item) for item in items if item.lower() != HF]
    if backends:
        if variants:
            raise ValueError("give attention backends either with --backends or as --compare KEY=VALUE variants, "
                             "not both (--compare hf may go with --backends)")
        names = [name.strip() for name in backends.split(",") if name.strip()]
        variants = [Variant(name, [f"attention.backend={name}"]) for name in names]
    if not variants:
        variants = [Variant("treadle")]
    return variants, with_hf


# ----------------------------------------------------------------------------- helpers


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treadle bench offline",
        description="Offline throughput of treadle configs (and HF transformers) on one synthetic workload.",
    )
    parser.add_argument("--workload", choices=WORKLOAD_NAMES, default="random")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="workload RNG seed")
    parser.add_argument("--input-len", default="32:512", help="random: prompt length range MIN:MAX")
    parser.add_argument("--output-len", default=None,
                        help="output length range MIN:MAX (default 16:128 random, 16:64 shared-prefix)")
    parser.add_argument("--prefix-len", type=int, default=400, help="shared-prefix: system prompt tokens")
    parser.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct system prompts")
    parser.add_argument("--question-len", default="16:48", help="shared-prefix: unique suffix length MIN:MAX")
    parser.add_argument("--compare", default=None,
                        help="comma-separated systems: 'hf' and/or treadle override sets 'K=V[;K=V]', "
                             "e.g. 'hf' or 'scheduler.policy=fcfs,scheduler.policy=lpm'")
    parser.add_argument("--backends", default=None,
                        help="shorthand for --compare attention.backend=A,attention.backend=B,...")
    parser.add_argument("--hf-batch-size", type=int, default=8, help="static batch size for HF generate")
    parser.add_argument("--warmup-prompts", type=int, default=4, help="requests run (untimed) before timing")
    add_config_args(parser)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for every system (default: torch's choice); on a shared CPU "
                             "1 avoids threads waiting on each other at every small op")
    parser.add_argument("--output", help="JSON path (default <results folder>/offline_<workload>_<date>.json)")
    parser.add_argument("--baseline", help="an earlier run's JSON: adds each system's ratio to its same-named "
                                           "system there (regression tracking)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="profile this many steps of a saturated stretch per treadle system (torch.profiler, "
                             "then cProfile); the summary goes into the JSON")
    parser.add_argument("--step-trace", action="store_true",
                        help="on a GPU, put every timed step (kind, batch size, tokens, requests waiting and "
                             "running, free KV slots, GPU ms, GPU ms idle before it) into the JSON")
    parser.add_argument("--json-schema", metavar="FILE",
                        help="A/B constrained decoding: each system also runs with every request constrained by "
                             "this JSON schema (e.g. bench/schemas/people.json), unconstrained at equal token counts")
    parser.add_argument("--no-progress", action="store_true", help="hide the tqdm bars")
    return parser


def _variant(item: str) -> Variant:
    pairs = [pair.strip() for pair in item.split(";") if pair.strip()]
    for pair in pairs:
        if "=" not in pair or pair.startswith("="):
            raise ValueError(f"--compare item '{item}': '{pair}' must look like section.key=value (or be 'hf')")
    return Variant(item, pairs)


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--set``, ``--device``, ``--dtype``: the base treadle config (see ``base_overrides``)."""
    parser.add_argument("--config", help="base treadle YAML config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a base config key (repeatable), e.g. --set model.load_format=dummy")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="= --set model.device=...")
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default=None,
                        help="= --set model.dtype=...")


def base_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides, with ``--device`` and ``--dtype`` as theirs."""
    overrides = list(args.set)
    if args.device:
        overrides.append(f"model.device={args.device}")
    if args.dtype:
        overrides.append(f"model.dtype={args.dtype}")
    return overrides


def _workload(args: argparse.Namespace, engine: Any) -> Workload:
    token_ids = usable_token_ids(engine.model_info["vocab_size"], engine.tokenizer)
    output_len = parse_len_range(args.output_len or _DEFAULT_OUTPUT_LEN[args.workload])
    if args.workload == "random":
        params = {"input_len": parse_len_range(args.input_len), "output_len": output_len}
    else:
        params = {"prefix_len": args.prefix_len, "num_prefixes": args.num_prefixes,
                  "question_len": parse_len_range(args.question_len), "output_len": output_len}
    return build_workload(args.workload, args.num_prompts, token_ids, seed=args.seed, **params)


def _describe(workload: Workload) -> str:
    s = workload.summary()
    return (f"workload {s['name']}: {s['num_requests']} requests, {s['input_tokens']} input tokens "
            f"(len {s['input_len_range'][0]}-{s['input_len_range'][1]}), {s['output_tokens']} output tokens "
            f"(len {s['output_len_range'][0]}-{s['output_len_range'][1]})")


def _default_name(workload: str) -> str:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"offline_{workload.replace('-', '_')}_{stamp}.json"


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    raise SystemExit(main())
