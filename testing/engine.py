"""Engine-level checks: nothing leaked after a workload."""

from __future__ import annotations

from typing import Any


def assert_kv_accounted(engine: Any, flush: bool = True) -> None:
    """Assert every KV slot is free or held by the prefix cache; then flush and expect all free."""
    stats = engine.kv_stats()
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats["free_slots"] + stats["cached_slots"] == stats["total_slots"], stats
    if flush:
        assert engine.flush_cache()
        stats = engine.kv_stats()
        assert stats["free_slots"] == stats["total_slots"], stats
