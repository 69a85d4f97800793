"""The treadle side of ``treadle bench offline``: one Engine configuration timed on the workload.

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
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from treadle.bench.offline_results import SystemResult, progress_line
from treadle.bench.workloads import BenchRequest, Workload
from treadle.core.config import ServerConfig

JSON_SCHEMA_ROUNDS = 2


@dataclass
class Variant:
    """One treadle configuration to run: a label and the overrides applied on top of the base config."""

    label: str
    overrides: list[str] = field(default_factory=list)


def make_engine(config: ServerConfig) -> Any:
    """A fresh Engine for one variant."""
    from treadle.core.engine import Engine

    return Engine(config)


def run_treadle(
    engine: Any, workload: Workload, variant: Variant, config: ServerConfig, warmup_prompts: int, progress: bool,
    profile_steps: int = 0, json_schema: str | None = None, step_trace: bool = False,
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
    meter = StepMeter(engine.scheduler, profile_steps=profile_steps, step_trace=step_trace)
    meter.install()
    bar = tqdm(total=workload.num_requests, desc=variant.label, unit="req", disable=not progress, file=sys.stderr)
    try:
        with bar:
            synchronize(device)
            start = time.perf_counter()
            meter.begin()
            verify_steps: list[int] = []
            completions = _drive_scheduler(
                engine.scheduler, [r.input_ids for r in workload.requests], [r.output_len for r in workload.requests],
                on_finish=lambda: bar.update(1), json_schema=json_schema, verify_steps=verify_steps,
            )
            meter.end()
            synchronize(device)
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
            **decode_graphs(engine),
            **({"spec_acceptance_length": sum(completions) / sum(verify_steps)} if sum(verify_steps) else {}),
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
            print(progress_line(result), flush=True)
            if result.name not in best or result.total_time_s < best[result.name].total_time_s:
                best[result.name] = result
    return [best[variant.label], best[constrained_variant.label]]


def config_value(engine: Any, section: str, key: str) -> Any:
    """A key of the engine's live config (``auto`` values are resolved there once the engine is built)."""
    return getattr(getattr(engine.scheduler.config, section), key)


def decode_graphs(engine: Any) -> dict[str, Any]:
    """The decode CUDA graphs' batch sizes kept after pruning and each captured size's ms per replay (empty
    on the CPU or with graphs off)."""
    graphs = getattr(getattr(engine.scheduler, "worker", None), "cuda_graphs", None)
    if graphs is None:
        return {}
    ms_per_replay = {bs: round(1e3 * s, 3) for bs, s in sorted(graphs.seconds_per_replay.items())}
    return {"decode_graph_batch_sizes": list(graphs.batch_sizes), "decode_graph_ms_per_replay": ms_per_replay}


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer brackets it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drive_scheduler(scheduler: Any, prompts: Sequence[list[int]], output_lens: Sequence[int],
                     on_finish: Any = None, json_schema: str | None = None,
                     verify_steps: list[int] | None = None) -> list[int]:
    """Queue every prompt as Engine.generate does (``scheduler.batch_order``), step until all finish;
    completion token counts in prompt order (and each finished request's verify steps appended to
    ``verify_steps``: speculative decoding)."""
    from treadle.core.engine import queue_order
    from treadle.core.request import Req, SamplingParams

    reqs = [
        Req(rid=Req.new_rid(), origin_input_ids=list(ids),
            sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=json_schema is None,
                                           json_schema=json_schema))
        for ids, n in zip(prompts, output_lens)
    ]
    for i in queue_order(output_lens, scheduler.config.scheduler.batch_order):
        scheduler.add_request(reqs[i])
    completions: dict[str, int] = {}
    while len(completions) < len(reqs):
        if not scheduler.has_work():
            raise RuntimeError(f"the scheduler went idle with {len(reqs) - len(completions)} requests unfinished")
        for output in scheduler.step():
            if output.finished_reason is not None:
                completions[output.rid] = output.completion_tokens
                if verify_steps is not None:
                    verify_steps.append(output.spec_verify_steps)
                if on_finish is not None:
                    on_finish()
    return [completions[req.rid] for req in reqs]
