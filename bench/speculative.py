"""Speculative decoding benchmarks (docs/speculative.md, docs/benchmarks.md).

``--part machinery`` (GPU): Llama-3.1-8B shapes with dummy weights and the test ``oracle`` speculator, which
proposes the target's own greedy continuation so every draft is accepted: what the verify machinery costs and
gives. With ``--topk`` above 1 the drafts form trees (``oracle_tree``: ``topk`` children per depth, the right one
last), so a verify step of ``k + 1`` nodes keeps ``k // topk`` drafts and its time includes the tree mask and the
kept path's K/V move. Per batch size (1, 8, 32 by default) the decode step of plain decoding and the verify step of k + 1 tokens,
each timed as ``(time for N new tokens - time for 1) / steps``, and tokens/s of both.

``--part ngram`` (any device): the embedded SmolLM2 with the ``ngram`` speculator on a copy-heavy workload
(prompts asking to repeat or edit a given text): tokens/s one request at a time and all requests at once
(``--many``, default 256), with and without, greedy outputs compared token for token.

Prints a table per part and writes the JSON to ``--output`` (default under the results folder).
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

from treadle.bench.offline_results import git_commit, machine_info
from treadle.bench.results_folder import results_dir
from treadle.bench.roofline import free_memory, synchronize
from treadle.bench.shapes import LLAMA_3_1_8B, write_config

ORACLE_PLUGIN = "treadle.testing.speculator_plugins"
NGRAM_PLUGIN = "treadle.plugins.speculators.ngram"
TEXTS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "All that glitters is not gold. Actions speak louder than words.",
    "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar and oxygen. It happens in the "
    "chloroplasts, where chlorophyll absorbs mostly red and blue light.",
    "def area(radius):\n    return 3.14159 * radius * radius\n\n\ndef circumference(radius):\n"
    "    return 2 * 3.14159 * radius\n",
    "Dear team, the meeting moves from Tuesday at ten to Thursday at two. Please bring the quarterly figures and "
    "the draft of the new hiring plan. Thanks, Maria.",
]
ASKS = [
    "Repeat this text exactly, word for word:\n\n{}",
    "Rewrite this text, changing nothing but fixing any typos:\n\n{}",
    "Copy the following text and add a title line before it:\n\n{}",
    "Rewrite this text with every number written in words, keeping everything else the same:\n\n{}",
]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    record: dict[str, Any] = {
        "benchmark": "speculative", "command": "python -m treadle.bench.speculative " + " ".join(argv or sys.argv[1:]),
        "date": dt.datetime.now().isoformat(timespec="seconds"), "machine": machine_info(),
        "treadle_commit": git_commit(), **({"note": args.note} if args.note else {}),
    }
    if args.part in ("machinery", "all"):
        record["machinery"] = machinery(args)
        print(format_machinery(record["machinery"]), flush=True)
    if args.part in ("ngram", "all"):
        record["ngram"] = ngram(args)
        print(format_ngram(record["ngram"]), flush=True)
    out = Path(args.output) if args.output else results_dir() / (
        f"speculative_{args.part}_{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m treadle.bench.speculative", description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["machinery", "ngram", "all"], default="all")
    parser.add_argument("--num-tokens", type=int, default=4, help="drafts per step (k)")
    parser.add_argument("--topk", type=int, default=1, help="machinery: draft tree width (1: chains)")
    parser.add_argument("--batch-sizes", default="1,8,32", help="machinery: batch sizes")
    parser.add_argument("--prompt-len", type=int, default=512, help="machinery: prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=257, help="machinery: tokens generated per request")
    parser.add_argument("--repeats", type=int, default=3, help="machinery: timed (1, N) call pairs per row")
    parser.add_argument("--backend", default="auto", help="machinery: attention.backend")
    parser.add_argument("--model-dir", default=None,
                        help="machinery: a model folder instead of Llama-3.1-8B's shapes (dummy weights either way)")
    parser.add_argument("--prompts", type=int, default=len(ASKS) * len(TEXTS),
                        help="ngram: how many of the workload's prompts run one at a time")
    parser.add_argument("--many", type=int, default=256, help="ngram: requests at once in the high-batch run")
    parser.add_argument("--ngram-new-tokens", type=int, default=128, help="ngram: max_new_tokens per request")
    parser.add_argument("--rounds", type=int, default=1, help="ngram: alternating runs of both engines")
    parser.add_argument("--note", default=None, help="a note stored in the JSON (where and how it ran)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (both)")
    parser.add_argument("--output", default=None)
    return parser


# ------------------------------------------------------------------ the machinery (oracle drafts)


def machinery(args: argparse.Namespace) -> dict[str, Any]:
    """Plain decode against verify steps whose drafts are all right, per batch size."""
    from treadle import Engine
    from treadle.core.config import load_config

    batch_sizes = [int(bs) for bs in args.batch_sizes.split(",")]
    model_dir = args.model_dir or write_config(Path(tempfile.mkdtemp(prefix="treadle-l8b-")), LLAMA_3_1_8B)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    max_bs = max(batch_sizes)
    base = {"model.path": model_dir, "model.load_format": "dummy", "model.dtype": "bfloat16",
            "model.context_length": args.prompt_len + args.new_tokens + 64, "attention.backend": args.backend,
            "scheduler.max_running_requests": max_bs, "runtime.cuda_graph_max_bs": max_bs,
            "plugins": [ORACLE_PLUGIN]}
    prompts = torch.randint(3, 500 if args.model_dir else 100000, (max_bs, args.prompt_len),
                            generator=torch.Generator().manual_seed(0))
    rows: dict[int, dict[str, Any]] = {bs: {"batch_size": bs} for bs in batch_sizes}
    plain_outputs: dict[int, list[list[int]]] = {}
    engine = Engine(load_config(overrides={**base, **_sets(args)}, use_env=False))
    try:
        for bs in batch_sizes:
            step, tokens, outputs = _time_steps(engine, prompts[:bs].tolist(), args, device)
            plain_outputs[bs] = outputs
            rows[bs].update(decode_step_ms=1e3 * step, plain_tok_s=bs / step)
    finally:
        engine.shutdown()
        free_memory()
    spec = {"speculative.method": "oracle" if args.topk == 1 else "oracle_tree",
            "speculative.num_tokens": args.num_tokens, "speculative.topk": args.topk,
            "speculative.max_batch_size": max_bs}
    engine = Engine(load_config(overrides={**base, **spec, **_sets(args)}, use_env=False))
    try:
        oracle = engine.scheduler.worker.speculator
        for bs in batch_sizes:
            token_lists = prompts[:bs].tolist()
            # The verify path's own greedy tokens (bf16 may break a near-tie differently from plain decode's).
            oracle.references = {tuple(p): o for p, o in zip(token_lists, plain_outputs[bs])}
            _, _, own = _time_steps(engine, token_lists, args, device, repeats=1)
            oracle.references = {tuple(p): o for p, o in zip(token_lists, own)}
            total, steps, _ = _time_steps(engine, token_lists, args, device, per_verify_step=True)
            row = rows[bs]
            row.update(verify_step_ms=1e3 * total / steps, spec_tok_s=bs * (args.new_tokens - 1) / total,
                       acceptance_length=(args.new_tokens - 1) / steps)
            row["verify_vs_decode"] = row["verify_step_ms"] / row["decode_step_ms"]
            row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
    finally:
        engine.shutdown()
        free_memory()
    return {"model": f"{args.model_dir or 'llama-3.1-8b'} (dummy weights)", "num_tokens": args.num_tokens,
            "topk": args.topk, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "device": str(device), "rows": list(rows.values())}


def _time_steps(engine: Any, token_lists: list[list[int]], args: argparse.Namespace, device: torch.device,
                repeats: int | None = None, per_verify_step: bool = False) -> tuple[float, Any, list[list[int]]]:
    """Median over call pairs of (time for N new tokens - time for 1): with ``per_verify_step`` that time and the
    verify steps of the first request; else one decode step's time and the tokens. Plus the outputs for N."""
    from treadle import SamplingParams

    def generate(new_tokens: int) -> tuple[float, list]:
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        engine.flush_cache()
        synchronize(device)
        start = time.perf_counter()
        outputs = engine.generate(input_ids=token_lists, sampling_params=params)
        synchronize(device)
        return time.perf_counter() - start, outputs

    generate(4)  # warm-up
    samples, outputs = [], []
    for _ in range(repeats or args.repeats):
        one, _ = generate(1)
        full, outputs = generate(args.new_tokens)
        samples.append(full - one)
    elapsed = sorted(samples)[len(samples) // 2]
    ids = [o.token_ids for o in outputs]
    if per_verify_step:
        return elapsed, max(outputs[0].spec_verify_steps, 1), ids
    return elapsed / (args.new_tokens - 1), None, ids


def format_machinery(result: dict[str, Any]) -> str:
    k = result["num_tokens"]
    shape = "oracle drafts" if result.get("topk", 1) == 1 else f"oracle trees of width {result['topk']}"
    lines = [f"speculative machinery: {result['model']}, {shape}, k = {k}, {result['device']}",
             f"{'bs':>4}  {'decode ms':>10}  {'verify ms':>10}  {'verify/decode':>13}  {'accept len':>10}  "
             f"{'plain tok/s':>11}  {'spec tok/s':>10}  {'speed-up':>8}"]
    for r in result["rows"]:
        lines.append(f"{r['batch_size']:>4}  {r['decode_step_ms']:>10.2f}  {r['verify_step_ms']:>10.2f}  "
                     f"{r['verify_vs_decode']:>12.2f}x  {r['acceptance_length']:>10.2f}  {r['plain_tok_s']:>11.1f}  "
                     f"{r['spec_tok_s']:>10.1f}  {r['speedup']:>7.2f}x")
    return "\n".join(lines)


# ------------------------------------------------------------------ n-gram on SmolLM2


def ngram(args: argparse.Namespace) -> dict[str, Any]:
    """SmolLM2 on copy-heavy prompts, one at a time and ``args.many`` at once, with and without ``ngram``.

    Both engines stay up and their runs alternate batch by batch (``--rounds`` times, which goes first swapped
    each time), so that a shared machine's changing load falls on both alike; tokens/s are over all rounds."""
    from treadle import Engine, SamplingParams
    from treadle.core.config import load_config
    from treadle.testing.tokenizer import chat_prompt_ids

    base = {"cache.max_total_tokens": 65536, "plugins": [NGRAM_PLUGIN], **_sets(args)}
    variants = {"plain": {}, "ngram": {"speculative.method": "ngram", "speculative.num_tokens": args.num_tokens}}
    params = SamplingParams(max_new_tokens=args.ngram_new_tokens, temperature=0.0)
    engines = {name: Engine(load_config(overrides={**base, **overrides}, use_env=False))
               for name, overrides in variants.items()}
    try:
        prompts = [chat_prompt_ids(engines["plain"].tokenizer, ask.format(text)) for ask, text in _pairs()]
        modes = {"bs1": [[p] for p in prompts[:args.prompts]],
                 f"bs{args.many}": [[prompts[i % len(prompts)] for i in range(args.many)]]}
        totals = {(name, mode): [0, 0, 0.0] for name in engines for mode in modes}  # tokens, verify steps, seconds
        outputs: dict[str, dict[str, dict[int, list[list[int]]]]] = {name: {} for name in engines}
        for engine in engines.values():
            engine.generate(input_ids=prompts[:2], sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0))
        for round_ in range(args.rounds):
            for mode, batches in modes.items():
                for b, batch in enumerate(batches):
                    # Batch by batch, which engine goes first alternating: both see the same load.
                    order = list(engines) if (round_ + b) % 2 == 0 else list(engines)[::-1]
                    for name in order:
                        engines[name].flush_cache()
                        counts, ids = _timed(engines[name], [batch], params)
                        totals[name, mode] = [x + y for x, y in zip(totals[name, mode], counts)]
                        outputs[name].setdefault(mode, {})[b] = ids
        result: dict[str, Any] = {
            "model": "SmolLM2-135M-Instruct (embedded)", "num_tokens": args.num_tokens, "many": args.many,
            "rounds": args.rounds, "new_tokens": args.ngram_new_tokens,
            "max_batch_size": engines["ngram"].resolved_config.speculative.max_batch_size}
        for name, engine in engines.items():
            result[name] = {"device": engine.model_info["device"]}
            for mode in modes:
                tokens, steps, seconds = totals[name, mode]
                result[name][f"{mode}_tok_s"] = tokens / seconds
                # Tokens per verify step; above k + 1 the run mostly decoded plainly (speculation turns itself off
                # above speculative.max_batch_size running requests), so no acceptance length is shown (JSON null).
                length = tokens / steps if steps else None
                result[name][f"{mode}_acceptance_length"] = length if length and length <= args.num_tokens + 1 else None
    finally:
        for engine in engines.values():
            engine.shutdown()
        free_memory()
    result["identical_outputs"] = outputs["plain"] == outputs["ngram"]
    for mode in modes:
        result[f"{mode}_speedup"] = result["ngram"][f"{mode}_tok_s"] / result["plain"][f"{mode}_tok_s"]
    return result


def _pairs() -> list[tuple[str, str]]:
    """Every (ask, text), ordered so that any first few cover different asks and texts (a Latin square)."""
    n = len(ASKS)
    return [(ASKS[i % n], TEXTS[(i % n + i // n) % n]) for i in range(n * n)]


def _timed(engine: Any, batches: list[list[list[int]]], params: Any) -> tuple[list[float], list[list[int]]]:
    """Generate each batch in turn: ``[output tokens, verify steps, seconds]`` and the outputs' tokens."""
    device = torch.device(engine.model_info["device"])
    tokens = steps = 0
    ids: list[list[int]] = []
    synchronize(device)
    start = time.perf_counter()
    for batch in batches:
        for output in engine.generate(input_ids=batch, sampling_params=params):
            tokens += output.completion_tokens
            steps += output.spec_verify_steps
            ids.append(output.token_ids)
    synchronize(device)
    return [tokens, steps, time.perf_counter() - start], ids


def format_ngram(result: dict[str, Any]) -> str:
    many = result["many"]
    lines = [f"ngram on copy-heavy prompts: {result['model']}, k = {result['num_tokens']}, "
             f"{result['plain']['device']}, speculation off above {result['max_batch_size']} running requests; "
             f"greedy outputs identical: {result['identical_outputs']}",
             f"{'':>8}  {'bs1 tok/s':>10}  {'accept len':>10}  {f'bs{many} tok/s':>12}  {'accept len':>10}"]
    for name in ("plain", "ngram"):
        r = result[name]
        lines.append(f"{name:>8}  {r['bs1_tok_s']:>10.1f}  {_length(r['bs1_acceptance_length']):>10}  "
                     f"{r[f'bs{many}_tok_s']:>12.1f}  {_length(r[f'bs{many}_acceptance_length']):>10}")
    lines.append(f"{'ratio':>8}  {result['bs1_speedup']:>9.2f}x  {'':>10}  {result[f'bs{many}_speedup']:>11.2f}x")
    return "\n".join(lines)


def _length(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _sets(args: argparse.Namespace) -> dict[str, str]:
    return dict(item.split("=", 1) for item in args.set)


if __name__ == "__main__":
    sys.exit(main())
