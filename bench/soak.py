"""Soak mode of the serving benchmark: mixed traffic for a fixed time, then leak checks.

``treadle bench serving --duration SECONDS [--abort-fraction F] [--disconnect-fraction F]
[--max-concurrency N] [--request-rate R] [--structured]``

For ``--duration`` seconds it sends a seeded mix of OpenAI requests — streaming and
non-streaming chat and completions, ``n > 1``, stop strings, and (``--structured``)
``response_format: json_object`` when the server accepts it — keeping at most
``--max-concurrency`` in flight (Poisson arrivals at ``--request-rate`` if given). Against a
server without a tokenizer (dummy weights) it sends token-id completions only.
A share of the requests is aborted on purpose through ``/abort_request``
(``--abort-fraction``) and a share is dropped by the client mid-stream
(``--disconnect-fraction``). At the end it checks that

- no request failed other than those aborted or dropped on purpose (a 503 is a failure too);
- once idle, every KV slot is free or held by the prefix cache (``/get_server_info``);
- the server's resident memory (all its processes) grew less than ``--max-memory-growth``
  (5%) between the end of the warm-up and the end; the warm-up lasts ``--warmup`` seconds and
  until the prefix cache has filled 90% of the KV pool (or half the soak has passed), because
  host memory that follows the cached prefixes grows until then and is bounded by the pool,

prints a table and writes JSON (``<results folder>/soak_<date>.json`` unless ``--output``).
Exit status 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from treadle.bench.results_folder import results_dir
from treadle.bench.workloads import usable_token_ids

_POOL_FILLED = 0.9  # share of KV slots cached or used at which the pool counts as filled
_WORDS = ("river stone light cloud paper garden window music winter orange silver market bridge forest "
          "engine letter island morning signal harbor candle mirror planet ticket valley").split()
KINDS = ("chat-stream", "chat", "completion-stream", "completion-n2", "chat-stop", "json")
# A server without a tokenizer (dummy weights from a bare config.json) takes token-id completions only.
TOKEN_ID_KINDS = ("completion-stream", "completion", "completion-n2")


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("soak mode (--duration)")
    group.add_argument("--duration", type=float, default=None,
                       help="soak: send mixed traffic for this many seconds, then check for leaks")
    group.add_argument("--abort-fraction", type=float, default=0.0, help="soak: share aborted via /abort_request")
    group.add_argument("--disconnect-fraction", type=float, default=0.0,
                       help="soak: share the client drops mid-stream")
    group.add_argument("--warmup", type=float, default=None,
                       help="soak: seconds before the memory baseline (default: 10%% of --duration, at most 60)")
    group.add_argument("--structured", action="store_true",
                       help="soak: include response_format json_object requests (skipped if the server refuses)")
    group.add_argument("--max-memory-growth", type=float, default=0.05,
                       help="soak: largest resident-memory growth after warm-up that passes (default 0.05)")
    group.add_argument("--admin-api-key", default=None, help="soak: key for /abort_request (default: --api-key)")


@dataclass
class SoakResult:
    """One soak request: what it was, how it ended."""

    index: int
    kind: str
    intent: str  # "normal", "abort" or "disconnect"
    ok: bool = False
    status: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    ttft_s: float | None = None
    latency_s: float = 0.0
    completion_tokens: int = 0
    error: str = ""


class Soak:
    """Drives the traffic and the checks against one server."""

    def __init__(self, args: argparse.Namespace, info: dict[str, Any]) -> None:
        self.args = args
        self.model = args.model or info.get("served_model_name")
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        admin = args.admin_api_key or args.api_key
        self.admin_headers = {"Authorization": f"Bearer {admin}"} if admin else {}
        self.rng = random.Random(args.seed)
        self.output_len = _parse_range(args.output_len)
        self.input_words = _parse_range(args.input_len)
        self.token_ids: list[int] | None = None
        self.kinds = [k for k in KINDS if k != "json"]
        if not info.get("has_tokenizer", True):
            self.token_ids = usable_token_ids(int(info["vocab_size"]))
            self.kinds = list(TOKEN_ID_KINDS)
        self.structured_note = "not requested"
        self.memory_samples: list[dict[str, Any]] = []

    async def run(self) -> dict[str, Any]:
        args = self.args
        timeout = httpx.Timeout(300, connect=30)
        limits = httpx.Limits(max_connections=(args.max_concurrency or 64) + 8)
        async with httpx.AsyncClient(base_url=args.base_url, headers=self.headers, timeout=timeout,
                                     limits=limits) as client:
            if args.structured and self.token_ids is None:
                await self._probe_structured(client)
            elif args.structured:
                self.structured_note = "skipped: the server has no tokenizer (token-id completions only)"
            start = time.monotonic()
            warmup = args.warmup if args.warmup is not None else min(60.0, 0.1 * args.duration)
            baseline: dict[str, Any] = {}
            sampler = asyncio.create_task(self._sample_memory(client, start, warmup, baseline))
            results = await self._traffic(client, start)
            wall = time.monotonic() - start
            sampler.cancel()
            idle_kv = await self._wait_idle(client)
            end_rss, end_per_process = await _rss(client)
        summary = self._report(results, wall, baseline, end_rss, idle_kv)
        summary["memory"]["end_per_process"] = end_per_process
        summary["memory"]["growth_last_half"] = growth_last_half(self.memory_samples, baseline.get("at_s"), end_rss)
        summary["memory"]["baseline_per_process"] = baseline.get("per_process")
        return summary

    # ------------------------------------------------------------ traffic

    async def _traffic(self, client: httpx.AsyncClient, start: float) -> list[SoakResult]:
        args = self.args
        limit = asyncio.Semaphore(args.max_concurrency or 16)
        tasks: list[asyncio.Task] = []
        index = 0
        rate = args.request_rate
        while time.monotonic() - start < args.duration:
            await limit.acquire()
            if time.monotonic() - start >= args.duration:
                limit.release()
                break
            plan = self._plan(index)
            task = asyncio.create_task(self._one(client, plan))
            task.add_done_callback(lambda _t: limit.release())
            tasks.append(task)
            index += 1
            if math.isfinite(rate) and rate > 0:
                await asyncio.sleep(self.rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))

    def _plan(self, index: int) -> dict[str, Any]:
        rng = random.Random(self.args.seed * 1_000_003 + index)
        roll = rng.random()
        intent = "normal"
        if roll < self.args.abort_fraction:
            intent = "abort"
        elif roll < self.args.abort_fraction + self.args.disconnect_fraction:
            intent = "disconnect"
        kind = rng.choice(self.kinds)
        if intent != "normal" and not kind.endswith("stream"):
            kind = rng.choice([k for k in self.kinds if k.endswith("stream")])
        words = rng.randint(*self.input_words)
        prompt: str | list[int] = (" ".join(rng.choice(_WORDS) for _ in range(words)) if self.token_ids is None
                                   else [rng.choice(self.token_ids) for _ in range(words)])
        body: dict[str, Any] = {"max_tokens": rng.randint(*self.output_len), "temperature": rng.choice([0.0, 0.8]),
                                "seed": index, "rid": f"soak-{self.args.seed}-{index}"}
        if self.model:
            body["model"] = self.model
        if kind.startswith("chat") or kind == "json":
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            path = "/v1/completions"
            body["prompt"] = prompt
        if kind.endswith("stream"):
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if kind == "completion-n2":
            body["n"] = 2
        if kind == "chat-stop":
            body["stop"] = [".", "\n"]
        if kind == "json":
            body["response_format"] = {"type": "json_object"}
        return {"index": index, "kind": kind, "intent": intent, "path": path, "body": body,
                "cut_after": rng.randint(1, 4), "abort_after": rng.uniform(0.0, 0.5)}

    async def _one(self, client: httpx.AsyncClient, plan: dict[str, Any]) -> SoakResult:
        result = SoakResult(plan["index"], plan["kind"], plan["intent"])
        start = time.monotonic()
        aborter = None
        if plan["intent"] == "abort":
            aborter = asyncio.create_task(self._abort_later(client, plan["body"]["rid"], plan["abort_after"]))
        try:
            if plan["body"].get("stream"):
                await self._stream(client, plan, result, start)
            else:
                response = await client.post(plan["path"], json=plan["body"])
                result.status = response.status_code
                if response.status_code == 200:
                    payload = response.json()
                    result.finish_reasons = [c["finish_reason"] for c in payload["choices"]]
                    result.completion_tokens = payload["usage"]["completion_tokens"]
                else:
                    result.error = response.text[:300]
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            if aborter is not None:
                aborter.cancel()
        result.latency_s = time.monotonic() - start
        result.ok = self._judge(result)
        return result

    async def _stream(self, client: httpx.AsyncClient, plan: dict[str, Any], result: SoakResult,
                      start: float) -> None:
        chunks = 0
        async with client.stream("POST", plan["path"], json=plan["body"]) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread())[:300].decode(errors="replace")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])[:300]
                    return
                if chunk.get("usage"):
                    result.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if result.ttft_s is None:
                        result.ttft_s = time.monotonic() - start
                    if choice.get("finish_reason"):
                        result.finish_reasons.append(choice["finish_reason"])
                chunks += 1
                if plan["intent"] == "disconnect" and chunks >= plan["cut_after"]:
                    return  # leaving the block closes the connection mid-stream

    async def _abort_later(self, client: httpx.AsyncClient, rid: str, delay: float) -> None:
        await asyncio.sleep(delay)
        await client.post("/abort_request", json={"rid": rid}, headers=self.admin_headers)

    @staticmethod
    def _judge(result: SoakResult) -> bool:
        if result.intent == "disconnect":
            return result.status in (0, 200) and (not result.error or result.error.startswith("ReadError"))
        if result.status != 200 or result.error:
            return False
        allowed = {"stop", "length", "abort"} if result.intent == "abort" else {"stop", "length"}
        return bool(result.finish_reasons) and set(result.finish_reasons) <= allowed

    async def _probe_structured(self, client: httpx.AsyncClient) -> None:
        body = {"messages": [{"role": "user", "content": "Reply in JSON."}], "max_tokens": 4,
                "response_format": {"type": "json_object"}}
        if self.model:
            body["model"] = self.model
        response = await client.post("/v1/chat/completions", json=body)
        if response.status_code == 200:
            self.kinds = list(KINDS)
            self.structured_note = "included"
        else:
            self.structured_note = f"skipped: the server answered {response.status_code}: {response.text[:160]}"

    # ------------------------------------------------------------ checks

    async def _sample_memory(self, client: httpx.AsyncClient, start: float, warmup: float,
                             baseline: dict[str, Any]) -> None:
        pool_filled = False
        while True:
            await asyncio.sleep(min(10.0, max(warmup, 1.0)))
            info = (await client.get("/get_server_info")).json()
            per_process = {k: v for k, v in (info.get("memory") or {}).get("rss_bytes", {}).items() if v}
            rss = sum(per_process.values())
            elapsed = time.monotonic() - start
            kv = info["kv"]
            # Host memory that follows the prefix cache (tree nodes, per-slot tables) stops growing once the
            # cache has filled the KV pool: the baseline waits for that (or for half the soak).
            pool_filled = pool_filled or kv["cached_slots"] + kv["used_slots"] >= _POOL_FILLED * kv["total_slots"]
            if rss:
                self.memory_samples.append({"at_s": round(elapsed, 1), "rss_bytes": per_process,
                                            "kv_cached_slots": kv.get("cached_slots")})
                warm = pool_filled or elapsed >= self.args.duration / 2
                if elapsed >= warmup and warm and "rss" not in baseline:
                    baseline.update(rss=rss, at_s=round(elapsed, 1), per_process=per_process,
                                    reason="KV pool filled" if pool_filled else "half the duration")

    async def _wait_idle(self, client: httpx.AsyncClient, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            kv = (await client.get("/get_server_info")).json()["kv"]
            if (kv["running"] == 0 and kv["waiting"] == 0) or time.monotonic() > deadline:
                return kv
            await asyncio.sleep(0.2)

    def _report(self, results: list[SoakResult], wall: float, baseline: dict[str, Any], end_rss: int | None,
                kv: dict[str, Any]) -> dict[str, Any]:
        on_purpose = [r for r in results if r.intent != "normal"]
        failed = [r for r in results if not r.ok]
        normal = [r for r in results if r.intent == "normal" and r.ok]
        latencies = sorted(r.latency_s * 1000 for r in normal)
        ttfts = sorted(r.ttft_s * 1000 for r in normal if r.ttft_s is not None)
        growth = None
        if baseline.get("rss") and end_rss:
            growth = (end_rss - baseline["rss"]) / baseline["rss"]
        kv_ok = kv["running"] == 0 and kv["waiting"] == 0 and kv["used_slots"] == 0 \
            and kv["free_slots"] + kv["cached_slots"] == kv["total_slots"]
        checks = {
            "no_failures": not failed,
            "kv_accounted": kv_ok,
            "memory_growth_below_limit": growth is not None and growth < self.args.max_memory_growth,
        }
        return {
            "requests": len(results),
            "completed": len(normal),
            "aborted_on_purpose": sum(r.intent == "abort" for r in results),
            "disconnected_on_purpose": sum(r.intent == "disconnect" for r in results),
            "failures": len(failed),
            "first_failures": [asdict(r) for r in failed[:5]],
            "by_kind": {k: sum(r.kind == k for r in results) for k in sorted({r.kind for r in results})},
            "structured_output": self.structured_note,
            "duration_s": wall,
            "request_throughput": len(results) / wall if wall else 0.0,
            "completion_tokens": sum(r.completion_tokens for r in results),
            "e2e_latency_ms": _percentiles(latencies),
            "ttft_ms": _percentiles(ttfts),
            "memory": {"baseline_rss_bytes": baseline.get("rss"), "baseline_at_s": baseline.get("at_s"),
                       "baseline_after": baseline.get("reason"),
                       "end_rss_bytes": end_rss, "growth": growth, "samples": self.memory_samples},
            "kv_at_end": kv,
            "checks": checks,
            "passed": all(checks.values()),
            "on_purpose_without_error": sum(r.ok for r in on_purpose),
        }


def growth_last_half(samples: list[dict[str, Any]], baseline_at_s: float | None, end_rss: int | None) -> float | None:
    """Growth from the sample halfway between the baseline and the end, to the end (informational).

    A leak keeps growing through the second half; an allocator's high-water mark (reached once, at the
    largest batch) does not.
    """
    if baseline_at_s is None or not end_rss:
        return None
    after = [s for s in samples if s["at_s"] >= baseline_at_s]
    if len(after) < 2:
        return None
    middle = after[len(after) // 2]
    rss = sum(middle["rss_bytes"].values())
    return (end_rss - rss) / rss if rss else None


def format_soak_table(summary: dict[str, Any]) -> str:
    growth = summary["memory"]["growth"]
    kv = summary["kv_at_end"]
    rows = [
        ("requests", str(summary["requests"])),
        ("completed / aborted / disconnected", f"{summary['completed']} / {summary['aborted_on_purpose']} / "
                                                f"{summary['disconnected_on_purpose']} (on purpose)"),
        ("failures", str(summary["failures"])),
        ("duration (s)", f"{summary['duration_s']:.1f}"),
        ("request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("E2E latency (ms)", _fmt(summary["e2e_latency_ms"])),
        ("TTFT (ms)", _fmt(summary["ttft_ms"])),
        ("resident memory growth", "n/a" if growth is None else f"{growth * 100:+.2f}% "
         f"({summary['memory']['baseline_rss_bytes'] / 2**20:.0f} -> {summary['memory']['end_rss_bytes'] / 2**20:.0f} MiB)"),
        ("  over the last half (informational)", "n/a" if summary["memory"].get("growth_last_half") is None
         else f"{summary['memory']['growth_last_half'] * 100:+.2f}%"),
        ("KV at end (free/cached/used/total)",
         f"{kv['free_slots']}/{kv['cached_slots']}/{kv['used_slots']}/{kv['total_slots']}"),
        ("structured output", summary["structured_output"]),
        ("checks", ", ".join(f"{k}: {'ok' if v else 'FAILED'}" for k, v in summary["checks"].items())),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def run_soak(args: argparse.Namespace, info: dict[str, Any]) -> int:
    """Entry point from ``bench/serving.py`` when ``--duration`` is given."""
    summary = asyncio.run(Soak(args, info).run())
    print(f"soak: {args.duration:g} s against {args.base_url}, max concurrency {args.max_concurrency or 16}, "
          f"rate {args.request_rate}/s, abort {args.abort_fraction:g}, disconnect {args.disconnect_fraction:g}")
    print(format_soak_table(summary))
    record = {
        "benchmark": "serving-soak",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": "treadle bench serving " + " ".join(getattr(args, "argv", [])),
        "base_url": args.base_url,
        "model": {k: info.get(k) for k in ("model_path", "served_model_name", "context_len", "device", "dtype")},
        "summary": summary,
    }
    out = Path(args.output) if args.output else results_dir() / f"soak_{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")
    return 0 if summary["passed"] else 1


async def _rss(client: httpx.AsyncClient) -> tuple[int | None, dict[str, int]]:
    """The server's total resident memory and each process's (from /get_server_info)."""
    info = (await client.get("/get_server_info")).json()
    per_process = {k: v for k, v in (info.get("memory") or {}).get("rss_bytes", {}).items() if v}
    return (sum(per_process.values()) or None), per_process


def _percentiles(sorted_ms: list[float]) -> dict[str, float]:
    if not sorted_ms:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}

    def pct(q: float) -> float:
        rank = (len(sorted_ms) - 1) * q / 100
        low = math.floor(rank)
        high = min(low + 1, len(sorted_ms) - 1)
        return sorted_ms[low] + (sorted_ms[high] - sorted_ms[low]) * (rank - low)

    return {"mean": sum(sorted_ms) / len(sorted_ms), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def _fmt(stats: dict[str, float]) -> str:
    return f"mean {stats['mean']:.1f}  p50 {stats['p50']:.1f}  p90 {stats['p90']:.1f}  p99 {stats['p99']:.1f}"


def _parse_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)
