"""Engine-level checks: nothing leaked after a workload."""

from __future__ import annotations

from typing import Any


def assert_kv_accounted(engine: Any, flush: bool = True) -> None:
    """Assert every KV slot is free or held by the prefix cache; then flush and expect all free.

    Under tensor parallelism this holds on every rank, and the ranks' pools agree.
    """
    for stats in _stats_per_rank(engine):
        assert stats["running"] == 0 and stats["waiting"] == 0 and stats["live_requests"] == 0, stats
        assert stats["free_slots"] + stats["cached_slots"] == stats["total_slots"], stats
    if flush:
        assert engine.flush_cache()
        per_rank = _stats_per_rank(engine)
        for stats in per_rank:
            assert stats["free_slots"] == stats["total_slots"], stats
        assert all(stats == per_rank[0] for stats in per_rank), per_rank


def _stats_per_rank(engine: Any) -> list[dict[str, int]]:
    per_rank = getattr(engine.scheduler, "kv_stats_per_rank", None)
    return per_rank() if per_rank is not None else [engine.kv_stats()]
