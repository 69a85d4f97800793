"""Offline throughput: one synthetic workload through several systems in one run, compared.

``treadle bench offline [--workload random|shared-prefix] [--compare SPEC] [--backends A,B] [--json-schema FILE]``

Systems are treadle configurations (the base config from ``--config``/``--set``
plus one override set per variant) and, with ``hf`` in ``--compare``, HF
transformers ``generate``. Every system gets the same prompts and must produce
the same number of tokens (treadle with ``ignore_eos``, HF with
``min_new_tokens``), greedily. Each system is warmed up first (not timed).

How HF is batched (fair to HF): requests are sorted by (output length, input
length) and cut into static batches of ``--hf-batch-size``, left-padded with an
attention mask; each batch generates its longest request's output length and
only the tokens each request asked for are counted (the extra tokens shorter
requests in a batch decode are reported as ``generated_tokens``).

How treadle is timed: all requests are queued on the Engine's scheduler at once
and stepped until every one finishes — the loop ``Engine.generate`` runs, minus
the final detokenization. Each variant runs on a fresh Engine whose prefix
cache is flushed after the warm-up.

With ``--json-schema FILE`` every system runs twice on the same engine: first
with each request constrained by the schema (label ``<system> +json-schema``;
requests end when their JSON is complete or at their output length), then
unconstrained with ``ignore_eos`` and each request's output length set to what
its constrained run produced — the same tokens generated, so the ratio is the
constraint's overhead. The pair runs twice, alternating; each system keeps its faster run.

Prints a table and writes JSON (``bench/results/offline_<workload>_<date>.json``
unless ``--output``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from treadle.bench.step_meter import format_profile
from treadle.bench.workloads import (WORKLOAD_NAMES, BenchRequest, Workload, build_workload, parse_len_range,
                                     usable_token_ids)
from treadle.core.config import ConfigError, ServerConfig, load_config

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HF = "hf"
_DEFAULT_OUTPUT_LEN = {"random": "16:128", "shared-prefix": "16:64"}
JSON_SCHEMA_ROUNDS = 2


@dataclass
class Variant:
    """One treadle configuration to run: a label and the overrides applied on top of the base config."""

    label: str
    overrides: list[str] = field(default_factory=list)


@dataclass
class SystemResult:
    """Timing of one system on the workload."""

    name: str
    kind: str  # "treadle" or "hf"
    overrides: list[str]
    config: dict[str, Any]
    total_time_s: float
    num_requests: int
    input_tokens: int
    output_tokens: int
    generated_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)
    ratio_vs_first: float | None = None
    ratio_vs_hf: float | None = None
    ratio_vs_baseline: float | None = None  # vs the same-named system of an earlier run (--baseline)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.total_time_s

    @property
    def request_throughput(self) -> float:
        return self.num_requests / self.total_time_s

    def to_json(self) -> dict[str, Any]:
        values = asdict(self)
        values["output_throughput_tok_s"] = self.output_throughput
        values["request_throughput_req_s"] = self.request_throughput
        values["total_throughput_tok_s"] = (self.input_tokens + self.output_tokens) / self.total_time_s
        return values


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        variants, with_hf = parse_variants(args.compare, args.backends)
        base_overrides = _base_overrides(args)
        configs = [load_config(args.config, base_overrides + v.overrides) for v in variants]
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
    hf_target: dict[str, Any] = {}
    for variant, config in zip(variants, configs):
        engine = _make_engine(config)
        if workload is None:
            workload = _workload(args, engine)
            print(_describe(workload), flush=True)
            hf_target = {
                "model_path": engine.model_info["model_path"],
                "dtype": engine.model_info["dtype"],
                "device": engine.model_info["device"],
                "load_format": config.model.load_format,
                "pad_token_id": _pad_token_id(engine),
            }
        if json_schema is not None:
            results.extend(run_json_schema_ab(engine, workload, variant, config, args, progress, json_schema))
        else:
            results.append(run_treadle(engine, workload, variant, config, args.warmup_prompts, progress,
                                       args.profile_steps))
            print(_progress_line(results[-1]), flush=True)
        if "profile" in results[-1].extra:
            print(format_profile(variant.label, results[-1].extra["profile"]), flush=True)
        engine.shutdown()
        del engine
        _free_memory()
    assert workload is not None
    if with_hf:
        results.append(run_hf(workload, args.hf_batch_size, hf_target, args.warmup_prompts, progress))
        _free_memory()

    _fill_ratios(results)
    if args.baseline:
        _fill_baseline_ratios(results, workload, Path(args.baseline))
    print(format_table(results))
    report = _report(args, argv, workload, results)
    path = Path(args.output) if args.output else RESULTS_DIR / _default_name(workload.name)
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


def run_treadle(
    engine: Any, workload: Workload, variant: Variant, config: ServerConfig, warmup_prompts: int, progress: bool,
    profile_steps: int = 0, json_schema: str | None = None,
) -> SystemResult:
    """Warm up, flush the prefix cache, then time the whole workload through the engine's scheduler.

    With ``json_schema`` every request is constrained by it and may end before its output length.

    A StepMeter records the GPU busy fraction and the peak batch sizes of the timed run
    (and, with ``profile_steps``, profiles one saturated stretch of it).
    """
    from tqdm import tqdm

    from treadle.bench.step_meter import StepMeter

    device = torch.device(engine.model_info["device"])
    if warmup_prompts > 0:
        warmup = workload.requests[:warmup_prompts]
        _drive_scheduler(engine.scheduler, [r.input_ids for r in warmup], [min(r.output_len, 8) for r in warmup],
                         json_schema=json_schema)
    if not engine.flush_cache():
        raise RuntimeError("flush_cache refused after the warm-up: requests are still in flight")
    before = engine.kv_stats()
    meter = StepMeter(engine.scheduler, profile_steps=profile_steps)
    meter.install()
    bar = tqdm(total=workload.num_requests, desc=variant.label, unit="req", disable=not progress, file=sys.stderr)
    try:
        with bar:
            _synchronize(device)
            start = time.perf_counter()
            meter.begin()
            completions = _drive_scheduler(
                engine.scheduler, [r.input_ids for r in workload.requests], [r.output_len for r in workload.requests],
                on_finish=lambda: bar.update(1), json_schema=json_schema,
            )
            meter.end()
            _synchronize(device)
            elapsed = time.perf_counter() - start
    finally:
        meter.uninstall()
    short = [(i, got, r.output_len) for i, (got, r) in enumerate(zip(completions, workload.requests))
             if got != r.output_len and json_schema is None]
    if short:
        i, got, want = short[0]
        raise RuntimeError(f"{variant.label}: request {i} generated {got} tokens instead of {want} "
                           f"({len(short)} requests short); the comparison would be unfair")
    after = engine.kv_stats()
    return SystemResult(
        name=variant.label,
        kind="treadle",
        overrides=list(variant.overrides),
        config=config.model_dump(mode="json"),
        total_time_s=elapsed,
        num_requests=workload.num_requests,
        input_tokens=workload.input_tokens,
        output_tokens=sum(completions) if json_schema is not None else workload.output_tokens,
        generated_tokens=sum(completions),
        extra={
            **({"completion_tokens": completions} if json_schema is not None else {}),
            "cached_prompt_tokens": after["cached_tokens_total"] - before["cached_tokens_total"],
            "retractions": after["retractions"] - before["retractions"],
            "kv_total_slots": after["total_slots"],
            "max_running_requests": config_value(engine, "scheduler", "max_running_requests"),
            "cuda_graph_max_bs": config_value(engine, "runtime", "cuda_graph_max_bs"),
            "enable_mixed_chunk": config_value(engine, "scheduler", "enable_mixed_chunk"),
            **meter.summary(),
            "model": engine.model_info,
        },
    )


def run_json_schema_ab(engine: Any, workload: Workload, variant: Variant, config: ServerConfig,
                       args: argparse.Namespace, progress: bool, json_schema: str) -> list[SystemResult]:
    """The variant unconstrained and constrained by ``json_schema`` at equal token counts, best of
    ``JSON_SCHEMA_ROUNDS`` alternating rounds each (a shared machine's noise hits one run, not the pair)."""
    constrained_variant = Variant(f"{variant.label} +json-schema", variant.overrides)
    best: dict[str, SystemResult] = {}
    for _ in range(JSON_SCHEMA_ROUNDS):
        constrained = run_treadle(engine, workload, constrained_variant, config, args.warmup_prompts, progress,
                                  args.profile_steps, json_schema)
        lengths = constrained.extra["completion_tokens"]
        same_tokens = Workload(workload.name, [BenchRequest(r.input_ids, n) for r, n in
                                               zip(workload.requests, lengths)], workload.params)
        free = run_treadle(engine, same_tokens, variant, config, args.warmup_prompts, progress, args.profile_steps)
        for result in (free, constrained):
            print(_progress_line(result), flush=True)
            if result.name not in best or result.total_time_s < best[result.name].total_time_s:
                best[result.name] = result
    return [best[variant.label], best[constrained_variant.label]]


def run_hf(
    workload: Workload, batch_size: int, target: dict[str, Any], warmup_prompts: int, progress: bool
) -> SystemResult:
    """HF transformers ``generate``: static left-padded batches sorted by output length, greedy."""
    from tqdm import tqdm

    model = _load_hf_model(target)
    device = torch.device(target["device"])
    pad_id = target["pad_token_id"]
    order = sorted(range(workload.num_requests),
                   key=lambda i: (workload.requests[i].output_len, len(workload.requests[i].input_ids)))
    batches = [[workload.requests[i] for i in order[s:s + batch_size]] for s in range(0, len(order), batch_size)]
    if warmup_prompts > 0:
        _hf_generate(model, workload.requests[:min(warmup_prompts, batch_size)], 4, pad_id, device)
    generated = 0
    bar = tqdm(total=workload.num_requests, desc=HF, unit="req", disable=not progress, file=sys.stderr)
    with bar:
        _synchronize(device)
        start = time.perf_counter()
        for batch in batches:
            new_tokens = max(r.output_len for r in batch)
            _hf_generate(model, batch, new_tokens, pad_id, device)
            generated += new_tokens * len(batch)
            bar.update(len(batch))
        _synchronize(device)
        elapsed = time.perf_counter() - start
    del model
    return SystemResult(
        name=HF,
        kind="hf",
        overrides=[],
        config={"batch_size": batch_size, "attn_implementation": "default (sdpa)", **target},
        total_time_s=elapsed,
        num_requests=workload.num_requests,
        input_tokens=workload.input_tokens,
        output_tokens=workload.output_tokens,
        generated_tokens=generated,
        extra={"transformers_version": _version("transformers")},
    )


def config_value(engine: Any, section: str, key: str) -> Any:
    """A key of the engine's live config (``auto`` values are resolved there once the engine is built)."""
    return getattr(getattr(engine.scheduler.config, section), key)


def format_table(results: Sequence[SystemResult]) -> str:
    """A plain-text table, one row per system."""
    with_hf = any(r.kind == "hf" for r in results)
    with_baseline = any(r.ratio_vs_baseline is not None for r in results)
    with_busy = any("gpu_busy_fraction" in r.extra for r in results)
    header = ["system", "reqs", "in tok", "out tok", "time s", "out tok/s", "req/s", "peak bs", "vs first"]
    if with_busy:
        header[-1:-1] = ["GPU busy", "busy (decode)"]
    if with_hf:
        header.append("vs hf")
    if with_baseline:
        header.append("vs baseline")
    rows = [header]
    for r in results:
        row = [r.name, str(r.num_requests), str(r.input_tokens), str(r.output_tokens), f"{r.total_time_s:.2f}",
               f"{r.output_throughput:.1f}", f"{r.request_throughput:.3f}",
               str(r.extra.get("peak_decode_batch_size", "-")), _ratio(r.ratio_vs_first)]
        if with_busy:
            row[-1:-1] = [_percent(r.extra.get("gpu_busy_fraction")), _percent(r.extra.get("gpu_busy_fraction_decode"))]
        if with_hf:
            row.append(_ratio(r.ratio_vs_hf))
        if with_baseline:
            row.append(_ratio(r.ratio_vs_baseline))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


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
    parser.add_argument("--config", help="base treadle YAML config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a base config key (repeatable), e.g. --set model.load_format=dummy")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None, help="= --set model.device=...")
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default=None,
                        help="= --set model.dtype=...")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for every system (default: torch's choice); on a shared CPU "
                             "1 avoids threads waiting on each other at every small op")
    parser.add_argument("--output", help="JSON path (default bench/results/offline_<workload>_<date>.json)")
    parser.add_argument("--baseline", help="an earlier run's JSON: adds each system's ratio to its same-named "
                                           "system there (regression tracking)")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="profile this many steps of a saturated stretch per treadle system (torch.profiler, "
                             "then cProfile); the summary goes into the JSON")
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


def _base_overrides(args: argparse.Namespace) -> list[str]:
    overrides = list(args.set)
    if args.device:
        overrides.append(f"model.device={args.device}")
    if args.dtype:
        overrides.append(f"model.dtype={args.dtype}")
    return overrides


def _make_engine(config: ServerConfig) -> Any:
    from treadle.core.engine import Engine

    return Engine(config)


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


def _drive_scheduler(scheduler: Any, prompts: Sequence[list[int]], output_lens: Sequence[int],
                     on_finish: Any = None, json_schema: str | None = None) -> list[int]:
    """Queue every prompt, step until all finish; completion token counts in prompt order."""
    from treadle.core.request import Req, SamplingParams

    reqs = [
        Req(rid=Req.new_rid(), origin_input_ids=list(ids),
            sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=json_schema is None,
                                           json_schema=json_schema))
        for ids, n in zip(prompts, output_lens)
    ]
    for req in reqs:
        scheduler.add_request(req)
    completions: dict[str, int] = {}
    while len(completions) < len(reqs):
        if not scheduler.has_work():
            raise RuntimeError(f"the scheduler went idle with {len(reqs) - len(completions)} requests unfinished")
        for output in scheduler.step():
            if output.finished_reason is not None:
                completions[output.rid] = output.completion_tokens
                if on_finish is not None:
                    on_finish()
    return [completions[req.rid] for req in reqs]


def _load_hf_model(target: dict[str, Any]) -> Any:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    dtype = getattr(torch, target["dtype"])
    if target["load_format"] == "dummy":
        # Random weights at the same shapes: throughput does not depend on the values.
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target["model_path"]))
    else:
        model = AutoModelForCausalLM.from_pretrained(target["model_path"], dtype=dtype)
    return model.to(device=target["device"], dtype=dtype).eval()


@torch.inference_mode()
def _hf_generate(model: Any, batch: Sequence[Any], new_tokens: int, pad_id: int, device: torch.device) -> None:
    width = max(len(r.input_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, r in enumerate(batch):
        input_ids[row, width - len(r.input_ids):] = torch.tensor(r.input_ids)
        attention_mask[row, width - len(r.input_ids):] = 1
    out = model.generate(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), do_sample=False,
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id,
        temperature=None, top_p=None, top_k=None,
    )
    if out.shape[1] - width != new_tokens:
        raise RuntimeError(f"HF generate produced {out.shape[1] - width} tokens instead of {new_tokens}")


def _pad_token_id(engine: Any) -> int:
    tokenizer = engine.tokenizer
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(candidate, int):
            return candidate
    eos = engine.model_info["eos_token_ids"]
    return eos[0] if eos else 0


def _fill_ratios(results: list[SystemResult]) -> None:
    first = results[0].output_throughput
    hf = next((r.output_throughput for r in results if r.kind == "hf"), None)
    for r in results:
        r.ratio_vs_first = r.output_throughput / first
        r.ratio_vs_hf = r.output_throughput / hf if hf else None


def _fill_baseline_ratios(results: list[SystemResult], workload: Workload, path: Path) -> None:
    """Ratio of each system's throughput to the same-named system in an earlier run's JSON."""
    earlier = json.loads(path.read_text())
    same = {k: earlier["workload"].get(k) for k in ("name", "num_requests", "input_tokens", "output_tokens")}
    now = {"name": workload.name, "num_requests": workload.num_requests,
           "input_tokens": workload.input_tokens, "output_tokens": workload.output_tokens}
    if same != now:
        print(f"warning: the baseline {path} ran a different workload ({same} vs {now}); ratios are not "
              "like for like", file=sys.stderr)
    throughput = {system["name"]: system["output_throughput_tok_s"] for system in earlier["systems"]}
    for r in results:
        if r.name in throughput:
            r.ratio_vs_baseline = r.output_throughput / throughput[r.name]


def _progress_line(r: SystemResult) -> str:
    """One system's figures as soon as it finishes (a later crash keeps them in the log)."""
    extra = r.extra
    return (f"{r.name}: {r.output_throughput:.1f} out tok/s, {r.total_time_s:.2f} s, peak decode batch "
            f"{extra.get('peak_decode_batch_size')}, GPU busy {_percent(extra.get('gpu_busy_fraction'))} "
            f"(decode {_percent(extra.get('gpu_busy_fraction_decode'))}), steps {extra.get('steps')} "
            f"({extra.get('decode_steps')} decode), max_running_requests {extra.get('max_running_requests')}, "
            f"retractions {extra.get('retractions')}")


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _report(args: argparse.Namespace, argv: Sequence[str] | None, workload: Workload,
            results: list[SystemResult]) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    hf = next((r for r in results if r.kind == "hf"), None)
    return {
        "benchmark": "offline_throughput",
        "command": "treadle bench offline " + shlex.join(argv),
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "treadle_commit": git_commit(),
        "workload": workload.summary(),
        "hf_batch_size": args.hf_batch_size if hf else None,
        "warmup_prompts": args.warmup_prompts,
        "systems": [r.to_json() for r in results],
        "ratios": {
            "vs_first": {r.name: r.ratio_vs_first for r in results},
            "vs_hf": {r.name: r.ratio_vs_hf for r in results} if hf else None,
        },
    }


def machine_info() -> dict[str, Any]:
    """CPU model, core count, load, torch build and GPU name (when there is one)."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
    }
    if hasattr(os, "getloadavg"):
        info["loadavg_1_5_15"] = list(os.getloadavg())
    return info


def git_commit() -> dict[str, Any] | None:
    """HEAD of the treadle checkout and whether the working tree has changes; None outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True,
                                timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"head": head, "dirty": bool(status.strip())}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _default_name(workload: str) -> str:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"offline_{workload.replace('-', '_')}_{stamp}.json"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    raise SystemExit(main())
