"""Prometheus metrics of the HTTP server (served at ``/metrics``).

Counters and latency histograms are updated by the TokenizerManager as outputs
arrive; the queue-length and KV gauges are refreshed from the scheduler's
``kv_stats()`` each time ``/metrics`` is scraped.

With several HTTP workers (``server.workers``) every worker counts its own
requests in prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``,
a folder the server makes and removes; it must be set before the first metric
is made, so the launcher sets it before any worker starts), and a scrape of any
worker sums them. Per-process metrics must be counters or histograms there; the
scheduler's values are gauges of :class:`SchedulerStatsCollector`, read once per
scrape, so they appear once whichever worker answers.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from treadle.server.ipc import StrOutput

_ACCEPTANCE_BUCKETS = tuple(float(n) for n in range(1, 17))
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The server's Prometheus collectors, in a registry of their own.

    ``multiprocess_dir``: the folder of prometheus-client's multiprocess mode, which ``/metrics`` then reads
    (every worker's counters summed); ``PROMETHEUS_MULTIPROC_DIR`` must name it before the first metric is made.
    """

    def __init__(self, multiprocess_dir: str | None = None) -> None:
        self.multiprocess_dir = multiprocess_dir
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
        # The scheduler's numbers, read from its kv_stats() at each scrape: exported once, by the worker scraped.
        self.scheduler_stats = SchedulerStatsCollector()
        self._scheduler_registry = CollectorRegistry()
        self._scheduler_registry.register(self.scheduler_stats)

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
        self.scheduler_stats.kv = dict(kv)
        self.scheduler_stats.replicas = list(replicas or [])

    def render(self) -> bytes:
        """The text format: this process's metrics, or with several workers every worker's summed."""
        if self.multiprocess_dir is None:
            registry = self.registry
        else:
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=self.multiprocess_dir)
        return generate_latest(registry) + generate_latest(self._scheduler_registry)


class SchedulerStatsCollector:
    """The scheduler-side gauges (queue lengths, KV usage, per-replica load) from the last stats read."""

    def __init__(self) -> None:
        self.kv: dict[str, Any] = {}
        self.replicas: list[dict[str, Any]] = []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        kv = self.kv
        total = int(kv.get("total_slots", 0))
        free = int(kv.get("free_slots", 0))
        used = kv.get("used_slots", max(total - free - int(kv.get("cached_slots", 0)), 0))
        for name, doc, value in (
            ("treadle_oom_retries", "Batches retracted and retried smaller after a device out-of-memory",
             kv.get("oom_retries", 0)),
            ("treadle_num_running_requests", "Requests in the running batch", kv.get("running", 0)),
            ("treadle_num_queued_requests", "Requests waiting to be admitted", kv.get("waiting", 0)),
            ("treadle_kv_total_slots", "KV cache slots in the pool", total),
            ("treadle_kv_used_slots", "KV slots held by running requests", used),
            ("treadle_kv_cached_slots", "KV slots held by the prefix cache", kv.get("cached_slots", 0)),
            ("treadle_kv_usage_ratio", "Share of KV slots in use (running + cached)",
             (total - free) / total if total else 0.0),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield from self._replica_families()

    def _replica_families(self) -> Iterator[GaugeMetricFamily]:
        families = {
            "running": GaugeMetricFamily("treadle_replica_num_running_requests",
                                         "Running requests per data-parallel replica", labels=["replica"]),
            "waiting": GaugeMetricFamily("treadle_replica_num_queued_requests",
                                         "Waiting requests per data-parallel replica", labels=["replica"]),
            "usage": GaugeMetricFamily("treadle_replica_kv_usage_ratio",
                                       "Share of KV slots in use per data-parallel replica", labels=["replica"]),
            "cached": GaugeMetricFamily("treadle_replica_cached_tokens_total",
                                        "Prompt tokens served from each replica's prefix cache", labels=["replica"]),
        }
        for index, kv in enumerate(self.replicas):
            label = [str(index)]
            total = int(kv.get("total_slots", 0))
            families["running"].add_metric(label, kv.get("running", 0))
            families["waiting"].add_metric(label, kv.get("waiting", 0))
            families["usage"].add_metric(label, (total - int(kv.get("free_slots", 0))) / total if total else 0.0)
            families["cached"].add_metric(label, kv.get("cached_tokens_total", 0))
        yield from families.values()
