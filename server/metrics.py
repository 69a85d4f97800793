"""Prometheus metrics of the HTTP server (served at ``/metrics``).

Counters and latency histograms are updated by the TokenizerManager as outputs
arrive; the queue-length and KV gauges are refreshed from the scheduler's
``kv_stats()`` each time ``/metrics`` is scraped.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from treadle.server.ipc import StrOutput

_ACCEPTANCE_BUCKETS = tuple(float(n) for n in range(1, 17))
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The server's Prometheus collectors, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_received = Counter("treadle_requests_received", "Generation requests received", registry=r)
        self.requests_finished = Counter(
            "treadle_requests_finished", "Generation requests finished, by finish reason", ["finish_reason"], registry=r)
        self.requests_aborted = Counter(
            "treadle_requests_aborted", "Requests aborted by the client or /abort_request", registry=r)
        self.requests_rejected = Counter(
            "treadle_requests_rejected", "Requests refused by admission control, by reason", ["reason"], registry=r)
        self.requests_timed_out = Counter(
            "treadle_requests_timed_out", "Requests stopped at their deadline (timeout)", registry=r)
        self.oom_retries = Gauge(
            "treadle_oom_retries", "Batches retracted and retried smaller after a device out-of-memory", registry=r)
        self.prompt_tokens = Counter("treadle_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("treadle_generation_tokens", "Generated tokens of finished requests", registry=r)
        self.cached_tokens = Counter("treadle_cached_tokens", "Prompt tokens served from the prefix cache", registry=r)
        self.time_to_first_token = Histogram(
            "treadle_time_to_first_token_seconds", "Time from arrival to the first output token",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram(
            "treadle_queue_time_seconds", "Time from arrival at the scheduler to admission into a batch",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "treadle_inter_token_latency_seconds", "Time between output tokens of one request",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            "treadle_e2e_request_latency_seconds", "Time from arrival to the last output token",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.spec_acceptance_length = Histogram(
            "treadle_spec_acceptance_length", "Tokens one verify step gave a request (accepted drafts + 1; "
            "speculative decoding only)", buckets=_ACCEPTANCE_BUCKETS, registry=r)
        self.running_requests = Gauge("treadle_num_running_requests", "Requests in the running batch", registry=r)
        self.queued_requests = Gauge("treadle_num_queued_requests", "Requests waiting to be admitted", registry=r)
        self.kv_total_slots = Gauge("treadle_kv_total_slots", "KV cache slots in the pool", registry=r)
        self.kv_used_slots = Gauge("treadle_kv_used_slots", "KV slots held by running requests", registry=r)
        self.kv_cached_slots = Gauge("treadle_kv_cached_slots", "KV slots held by the prefix cache", registry=r)
        self.kv_usage = Gauge("treadle_kv_usage_ratio", "Share of KV slots in use (running + cached)", registry=r)
        labels = ["replica"]
        self.replica_running = Gauge(
            "treadle_replica_num_running_requests", "Running requests per data-parallel replica", labels, registry=r)
        self.replica_queued = Gauge(
            "treadle_replica_num_queued_requests", "Waiting requests per data-parallel replica", labels, registry=r)
        self.replica_kv_usage = Gauge(
            "treadle_replica_kv_usage_ratio", "Share of KV slots in use per data-parallel replica", labels, registry=r)
        self.replica_cached_tokens = Gauge(
            "treadle_replica_cached_tokens_total", "Prompt tokens served from each replica's prefix cache",
            labels, registry=r)

    def on_verified(self, output: StrOutput) -> None:
        """A speculative step's output: how many tokens each of its verify steps gave the request."""
        for length in output.new_verify_lengths:
            self.spec_acceptance_length.observe(length)

    def on_finished(self, output: StrOutput, latency_s: float) -> None:
        self.requests_finished.labels(finish_reason=output.finished_reason or "unknown").inc()
        self.prompt_tokens.inc(output.prompt_tokens)
        self.generation_tokens.inc(output.completion_tokens)
        self.cached_tokens.inc(output.cached_tokens)
        self.e2e_latency.observe(latency_s)

    def set_scheduler_stats(self, kv: dict[str, Any], replicas: list[dict[str, Any]] | None = None) -> None:
        """Refresh the gauges from the scheduler's ``kv_stats()`` (summed over replicas) and, with data
        parallelism, each replica's own."""
        for index, replica_kv in enumerate(replicas or []):
            label = str(index)
            total = int(replica_kv.get("total_slots", 0))
            self.replica_running.labels(replica=label).set(replica_kv.get("running", 0))
            self.replica_queued.labels(replica=label).set(replica_kv.get("waiting", 0))
            self.replica_kv_usage.labels(replica=label).set(
                (total - int(replica_kv.get("free_slots", 0))) / total if total else 0.0)
            self.replica_cached_tokens.labels(replica=label).set(replica_kv.get("cached_tokens_total", 0))
        total = int(kv.get("total_slots", 0))
        free = int(kv.get("free_slots", 0))
        self.running_requests.set(kv.get("running", 0))
        self.queued_requests.set(kv.get("waiting", 0))
        self.kv_total_slots.set(total)
        self.kv_used_slots.set(kv.get("used_slots", max(total - free - int(kv.get("cached_slots", 0)), 0)))
        self.kv_cached_slots.set(kv.get("cached_slots", 0))
        self.kv_usage.set((total - free) / total if total else 0.0)
        self.oom_retries.set(kv.get("oom_retries", 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
