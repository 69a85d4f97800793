"""How evenly each data-parallel routing policy spreads work over replicas: a simulation, no GPU and no server.

The requests of a serving workload (:mod:`treadle.bench.workloads`, the same seeded lengths ``treadle bench serving``
sends) are routed all at once, as in the GPU runs' 1000-at-once phase where none finishes before the last is routed,
through :class:`~treadle.server.dp_routing.ReplicaRouter` under each ``parallel.dp_policy``. A replica's work is the
tokens it must process: its requests' prompt tokens less those its prefix cache already holds (modelled per replica by
the prompt blocks it was sent before, as many as ``--cache-tokens`` hold, least recent forgotten first) plus their
output tokens (``ignore_eos``: exactly the workload's lengths). The slowest replica decides when an all-at-once run
ends, so the table's ``max/mean`` (the busiest replica's work over the mean) is the run time lost to imbalance.
Requests go in the workload's order; ``--orders N`` also routes N shuffles of it (several client processes reach the
server interleaved) and reports max/mean's mean and 90th percentile over them::

    treadle bench dp-balance --orders 100                      # random 16-600 in, 16-400 out; dp=2 and 4
    treadle bench dp-balance --workload shared-prefix --num-prompts 1200 --num-prefixes 97 \\
        --prefix-len 4000 --output-len 16:64 --replicas 2 --cache-tokens 400000          # multi_gpu.sh dp_prefix

Writes JSON to ``--output`` (default: the results folder outside the tree).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any, Sequence

from treadle.bench.results_folder import default_output
from treadle.bench.workloads import WORKLOAD_NAMES, Workload, serving_workload
from treadle.server.dp_routing import DP_POLICIES, PREFIX_BLOCK_TOKENS, PrefixTracker, ReplicaRouter, block_keys

LLAMA_3_VOCAB = 128_256


def simulate(workload: Workload, policy: str, replicas: int, cache_tokens: int) -> dict[str, Any]:
    """Route every request of ``workload`` under ``policy`` before any finishes; each replica's requests, prompt
    tokens, prompt tokens found in its cache, output tokens and work (prompt - cached + output)."""
    router = ReplicaRouter(policy, replicas)
    caches = [PrefixTracker(capacity=max(cache_tokens // PREFIX_BLOCK_TOKENS, 1)) for _ in range(replicas)]
    rows = [{"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0, "work": 0}
            for _ in range(replicas)]
    for index, request in enumerate(workload.requests):
        replica = router.choose(f"req-{index}", request.input_ids, request.output_len)
        cached = min(caches[replica].matched_blocks(block_keys(request.input_ids)) * PREFIX_BLOCK_TOKENS,
                     len(request.input_ids) - 1)
        caches[replica].add(request.input_ids)
        row = rows[replica]
        row["requests"] += 1
        row["prompt_tokens"] += len(request.input_ids)
        row["cached_tokens"] += cached
        row["output_tokens"] += request.output_len
        row["work"] += len(request.input_ids) - cached + request.output_len
    work = [row["work"] for row in rows]
    mean = sum(work) / replicas
    prompt = sum(row["prompt_tokens"] for row in rows)
    return {"policy": policy, "replicas": replicas, "per_replica": rows,
            "max_over_mean": max(work) / mean if mean else 1.0,
            "total_work": sum(work),
            "cache_hit_rate": sum(row["cached_tokens"] for row in rows) / prompt if prompt else 0.0}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    workload = serving_workload(args, range(args.vocab_size))
    runs = [simulate(workload, policy, replicas, args.cache_tokens)
            for replicas in args.replicas for policy in args.policies]
    for run in runs if args.orders else []:
        run["arrival_orders"] = _over_orders(workload, run["policy"], run["replicas"], args)
    _print_table(workload, runs)
    result = {"bench": "dp_balance", "workload": workload.summary(), "cache_tokens": args.cache_tokens,
              "runs": runs}
    output = Path(args.output) if args.output else default_output(f"dp_balance_{workload.name}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    print(f"wrote {output}")
    return 0


def _over_orders(workload: Workload, policy: str, replicas: int, args: argparse.Namespace) -> dict[str, float]:
    """max/mean over ``args.orders`` shuffles of the arrival order (a server sees the requests of several client
    processes interleaved): its mean and 90th percentile."""
    ratios = []
    for order in range(args.orders):
        requests = list(workload.requests)
        random.Random(order).shuffle(requests)
        shuffled = Workload(workload.name, requests, workload.params)
        ratios.append(simulate(shuffled, policy, replicas, args.cache_tokens)["max_over_mean"])
    ratios.sort()
    return {"orders": args.orders, "mean": sum(ratios) / len(ratios), "p90": ratios[int(0.9 * (len(ratios) - 1))]}


def _print_table(workload: Workload, runs: list[dict[str, Any]]) -> None:
    print(f"{workload.name}: {workload.num_requests} requests at once, {workload.input_tokens} prompt + "
          f"{workload.output_tokens} output tokens")
    print(f"{'dp':>3} {'policy':<15} {'max/mean':>8} {'hit rate':>8} {'total work':>11}  work per replica (requests)")
    for run in runs:
        spread = "  ".join(f"{row['work']}({row['requests']})" for row in run["per_replica"])
        print(f"{run['replicas']:>3} {run['policy']:<15} {run['max_over_mean']:>8.4f} {run['cache_hit_rate']:>8.3f} "
              f"{run['total_work']:>11}  {spread}")
        if "arrival_orders" in run:
            orders = run["arrival_orders"]
            print(f"{'':>20}over {orders['orders']} shuffled arrival orders: max/mean {orders['mean']:.4f} mean, "
                  f"{orders['p90']:.4f} p90")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle bench dp-balance", description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=WORKLOAD_NAMES, default="random")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", default="16:600", help="MIN:MAX prompt tokens (random workload)")
    parser.add_argument("--output-len", default="16:400", help="MIN:MAX output tokens")
    parser.add_argument("--prefix-len", type=int, default=4000, help="shared-prefix workload: system prompt tokens")
    parser.add_argument("--num-prefixes", type=int, default=97, help="shared-prefix workload: system prompts")
    parser.add_argument("--question-len", default="16:48", help="shared-prefix workload: MIN:MAX question tokens")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed (treadle bench serving's --seed)")
    parser.add_argument("--vocab-size", type=int, default=LLAMA_3_VOCAB, help="prompt token ids are drawn below this")
    parser.add_argument("--orders", type=int, default=0,
                        help="also route the requests in this many shuffled orders: max/mean's mean and p90")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4], help="dp sizes to simulate")
    parser.add_argument("--policies", nargs="+", choices=DP_POLICIES, default=list(DP_POLICIES))
    parser.add_argument("--cache-tokens", type=int, default=2_000_000,
                        help="prompt tokens one replica's prefix cache holds in the model (its KV pool's size)")
    parser.add_argument("--output", default=None, help="JSON path (default <results folder>/dp_balance_<workload>.json)")
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
