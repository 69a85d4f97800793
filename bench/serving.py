"""Online serving benchmark: an async load generator against a running server.

``treadle bench serving --base-url http://127.0.0.1:30000 [--num-prompts 200] [--request-rate 8]
[--max-concurrency 32] [--workload random|shared-prefix] [--api openai|native]``

Requests arrive as a Poisson process at ``--request-rate`` per second (``inf``:
all at once), at most ``--max-concurrency`` in flight. Every request streams
and generates exactly its workload output length (``ignore_eos``). Reports
request and token throughput, time to first token (TTFT), inter-token latency
(ITL: gaps between streamed tokens) and end-to-end latency percentiles; prints
a table and writes JSON (``<results folder>/serving_<workload>_<date>.json``
unless ``--output``).

``--duration SECONDS`` switches to the soak mode of ``bench/soak.py`` (mixed traffic,
aborts and disconnects on purpose, then leak checks); there ``--input-len`` counts words.

``--api native`` streams ``/generate`` (one event per scheduler step while the server keeps up; a response
that fell behind sends one event for every step it has, whose tokens share the gap evenly); ``--api openai``
streams ``/v1/completions`` and works against any OpenAI-compatible server (a chunk may then carry more than
one token).

One client process parses every streamed event in Python (~0.1 ms each on a 2-core CPU), so at
thousands of tokens per second it can become the bottleneck it is meant to measure; ``--client-processes N``
(or its older name ``--workers N``; not to be confused with the server's ``server.workers``) spreads the requests over N processes (each its share of the arrivals: a Poisson process of
``rate / N``, and of ``--max-concurrency``), started together.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import multiprocessing
import queue
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx
from tqdm import tqdm

from treadle.bench.results_folder import results_dir
from treadle.bench.soak import add_soak_arguments, run_soak
from treadle.bench.workloads import WORKLOAD_NAMES, BenchRequest, serving_workload, usable_token_ids



@dataclass
class RequestResult:
    """What one streamed request measured."""

    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    cached_tokens: int = 0  # prompt tokens the server's prefix cache supplied (its meta_info / usage)


async def run_benchmark(base_url: str, requests: Sequence[BenchRequest], request_rate: float,
                        max_concurrency: int | None, api: str = "native", api_key: str | None = None,
                        model: str | None = None, seed: int = 0, on_done: Callable[[], None] | None = None
                        ) -> tuple[list[RequestResult], float]:
    """Send ``requests`` with Poisson arrivals; returns the per-request results and the wall time.
    ``on_done`` is called as each request ends (a progress bar's update)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed)
    timeout = httpx.Timeout(None, connect=30)
    pool = httpx.Limits(max_connections=max_concurrency or len(requests) or 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=pool) as client:

        async def one(req: BenchRequest) -> RequestResult:
            if limit is None:
                result = await _send(client, req, api, model)
            else:
                async with limit:
                    result = await _send(client, req, api, model)
            if on_done is not None:
                on_done()
            return result

        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(request_rate) and request_rate > 0:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


async def _send(client: httpx.AsyncClient, req: BenchRequest, api: str, model: str | None) -> RequestResult:
    if api == "native":
        path, body = "/generate", {"input_ids": req.input_ids, "stream": True, "sampling_params": {
            "max_new_tokens": req.output_len, "temperature": 0, "ignore_eos": True}}
    else:
        path, body = "/v1/completions", {"prompt": req.input_ids, "max_tokens": req.output_len, "temperature": 0,
                                         "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if model:
            body["model"] = model
    result = RequestResult(ok=False, prompt_tokens=len(req.input_ids))
    start = last = time.perf_counter()
    tokens = 0
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                now = time.perf_counter()
                if api == "native":
                    new = len(chunk["output_ids"]) - tokens
                    result.cached_tokens = (chunk.get("meta_info") or {}).get("cached_tokens", result.cached_tokens)
                elif chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                    result.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    continue
                else:
                    new = 1 if chunk.get("choices") and chunk["choices"][0].get("text") else 0
                if new <= 0:
                    continue
                if tokens == 0:
                    result.ttft_s = now - start
                else:
                    result.itl_s.extend([(now - last) / new] * new)
                tokens += new
                last = now
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.ok = True
    result.output_tokens = tokens
    result.latency_s = time.perf_counter() - start
    return result


def run_workers(base_url: str, requests: Sequence[BenchRequest], request_rate: float, max_concurrency: int | None,
                api: str, api_key: str | None, model: str | None, seed: int, workers: int, progress: bool = False
                ) -> tuple[list[RequestResult], float]:
    """:func:`run_benchmark` from ``workers`` processes started together: every ``workers``-th request each;
    the results come back in request order, and the wall time runs until the last process is done.
    ``progress``: a bar on stderr counts the requests done."""
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress, file=sys.stderr,
               mininterval=0.5, dynamic_ncols=True)
    with bar:
        if workers <= 1:
            return asyncio.run(run_benchmark(base_url, requests, request_rate, max_concurrency, api, api_key, model,
                                             seed, on_done=bar.update))
        context = multiprocessing.get_context("spawn")
        start = context.Barrier(workers + 1)
        inbox = context.Queue()
        done = context.Value("i", 0)
        concurrency = -(-max_concurrency // workers) if max_concurrency else None
        processes = [
            context.Process(target=_worker, daemon=True, args=(
                index, start, inbox, done, base_url, list(requests[index::workers]), request_rate / workers,
                concurrency, api, api_key, model, seed + index))
            for index in range(workers)
        ]
        for process in processes:
            process.start()
        start.wait()
        started = time.monotonic()
        shares: dict[int, list[RequestResult]] = {}
        finished = []
        while len(shares) < workers:
            try:
                index, results, ended = inbox.get(timeout=0.5)
            except queue.Empty:
                bar.update(done.value - bar.n)
                continue
            shares[index] = results
            finished.append(ended)
        bar.update(len(requests) - bar.n)
        for process in processes:
            process.join()
    ordered = [shares[i % workers][i // workers] for i in range(len(requests))]
    return ordered, max(finished) - started


def _worker(index: int, start: Any, outbox: Any, done: Any, base_url: str, requests: list[BenchRequest],
            request_rate: float, max_concurrency: int | None, api: str, api_key: str | None, model: str | None,
            seed: int) -> None:
    def count() -> None:
        with done.get_lock():
            done.value += 1

    start.wait()
    results, _ = asyncio.run(run_benchmark(base_url, requests, request_rate, max_concurrency, api, api_key, model,
                                           seed, on_done=count))
    outbox.put((index, results, time.monotonic()))


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """Throughput and latency percentiles (milliseconds) over the successful requests."""
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    itl = [x for r in done for x in r.itl_s]
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": wall_s,
        "request_throughput": len(done) / wall_s if wall_s else 0.0,
        "input_token_throughput": prompt_tokens / wall_s if wall_s else 0.0,
        "output_token_throughput": output_tokens / wall_s if wall_s else 0.0,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "cached_tokens": sum(r.cached_tokens for r in done),
        "cache_hit_rate": sum(r.cached_tokens for r in done) / prompt_tokens if prompt_tokens else 0.0,
    }
    for name, values in (("ttft_ms", [r.ttft_s for r in done]), ("itl_ms", itl),
                         ("e2e_latency_ms", [r.latency_s for r in done])):
        ms = sorted(v * 1000 for v in values)
        summary[name] = {"mean": sum(ms) / len(ms) if ms else 0.0,
                         **{f"p{q}": _percentile(ms, q) for q in (50, 90, 99)}}
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["first_errors"] = errors[:5]
    return summary


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    rank = (len(sorted_values) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def format_table(summary: dict[str, Any]) -> str:
    rows = [
        ("completed / failed", f"{summary['completed']} / {summary['failed']}"),
        ("duration (s)", f"{summary['duration_s']:.2f}"),
        ("request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("input throughput (tok/s)", f"{summary['input_token_throughput']:.1f}"),
        ("output throughput (tok/s)", f"{summary['output_token_throughput']:.1f}"),
        ("prefix cache hit rate", f"{summary.get('cache_hit_rate', 0.0):.1%} of prompt tokens"),
    ]
    for name, label in (("ttft_ms", "TTFT (ms)"), ("itl_ms", "ITL (ms)"), ("e2e_latency_ms", "E2E latency (ms)")):
        s = summary[name]
        rows.append((label, f"mean {s['mean']:.1f}  p50 {s['p50']:.1f}  p90 {s['p90']:.1f}  p99 {s['p99']:.1f}"))
    if "spec_acceptance_length" in summary:
        rows.append(("acceptance length (tok/verify step)", f"{summary['spec_acceptance_length']:.2f}"))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle bench serving", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--api", choices=["native", "openai"], default="native")
    parser.add_argument("--model", default=None, help="model name for --api openai (default: the server's)")
    parser.add_argument("--workload", choices=WORKLOAD_NAMES, default="random")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len", default="32:256", help="MIN:MAX prompt tokens (random workload)")
    parser.add_argument("--output-len", default="16:128", help="MIN:MAX output tokens")
    parser.add_argument("--prefix-len", type=int, default=400, help="shared-prefix workload: system prompt tokens")
    parser.add_argument("--num-prefixes", type=int, default=1,
                        help="shared-prefix workload: distinct system prompts, requests cycling through them")
    parser.add_argument("--question-len", default="16:48", help="shared-prefix workload: MIN:MAX question tokens")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = all at once")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-processes", "--workers", dest="workers", type=int, default=1,
                        help="client processes sharing the requests (one Python process parses ~10k events/s); "
                             "--workers is the older name")
    parser.add_argument("--output", default=None, help="JSON path (default <results folder>/serving_<workload>_<date>.json)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--keep-token-gaps", action="store_true",
                        help="write each request's inter-token gaps (itl_s, seconds) into the JSON, to see which "
                             "steps make the ITL tail (~1 MB per 100k tokens); without it they are left out")
    add_soak_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        info = httpx.get(f"{args.base_url}/get_model_info", headers=headers, timeout=30).json()
    except httpx.HTTPError as exc:
        print(f"error: cannot reach a server at {args.base_url}: {exc}", file=sys.stderr)
        return 1
    if args.duration is not None:
        args.argv = _without_secrets(argv if argv is not None else sys.argv[1:])
        return run_soak(args, info)
    token_ids = usable_token_ids(int(info["vocab_size"]))
    workload = serving_workload(args, token_ids)

    if args.workers < 1:
        parser.error("--client-processes must be at least 1")
    verified_before = acceptance_counts(args.base_url, headers)
    results, wall = run_workers(args.base_url, workload.requests, args.request_rate, args.max_concurrency, args.api,
                                args.api_key, args.model, args.seed, args.workers, progress=not args.no_progress)
    summary = summarize(results, wall)
    verified_after = acceptance_counts(args.base_url, headers)
    steps = verified_after[1] - verified_before[1]
    if steps > 0:  # speculative decoding: tokens per verify step, from the server's /metrics
        summary["spec_acceptance_length"] = (verified_after[0] - verified_before[0]) / steps
    print(f"serving benchmark: {workload.num_requests} requests ({args.workload}), rate {args.request_rate}/s, "
          f"max concurrency {args.max_concurrency or 'unlimited'}, api {args.api}, {args.base_url}, "
          f"{args.workers} client process{'es' if args.workers > 1 else ''}")
    print(format_table(summary))
    from treadle.bench.offline_results import git_commit, machine_info

    record = {
        "benchmark": "serving",
        "command": "treadle bench serving " + " ".join(_without_secrets(argv if argv is not None else sys.argv[1:])),
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),  # the client's; the server's device is under "model"
        "treadle_commit": git_commit(),
        "base_url": args.base_url,
        "api": args.api,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "max_concurrency": args.max_concurrency,
        "client_workers": args.workers,
        "model": {k: info.get(k) for k in ("model_path", "served_model_name", "context_len", "device", "dtype")},
        "workload": workload.summary(),
        "summary": summary,
        "requests": [asdict(r) if args.keep_token_gaps else asdict(r) | {"itl_s": None} for r in results],
    }
    out = Path(args.output) if args.output else results_dir() / (
        f"serving_{args.workload}_{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")
    return 0 if summary["failed"] == 0 else 1


def acceptance_counts(base_url: str, headers: dict[str, str]) -> tuple[float, float]:
    """``(tokens, verify steps)`` of the server's acceptance-length histogram so far (0, 0 without speculation
    or without a /metrics answer)."""
    try:
        text = httpx.get(f"{base_url}/metrics", headers=headers, timeout=30).text
    except httpx.HTTPError:
        return 0.0, 0.0
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("treadle_spec_acceptance_length_sum", "treadle_spec_acceptance_length_count"):
            values[name] = float(value)
    return (values.get("treadle_spec_acceptance_length_sum", 0.0),
            values.get("treadle_spec_acceptance_length_count", 0.0))


def _without_secrets(argv: Sequence[str]) -> list[str]:
    """The command line with the value of ``--api-key`` masked (it goes into the results JSON)."""
    masked, hide_next = [], False
    for arg in argv:
        if hide_next:
            masked.append("***")
        elif arg.startswith("--api-key="):
            masked.append("--api-key=***")
        else:
            masked.append(arg)
        hide_next = arg == "--api-key"
    return masked


if __name__ == "__main__":
    raise SystemExit(main())

