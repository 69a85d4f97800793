"""The collector settings a scheduler process runs under, and that an Engine gives them back."""

from __future__ import annotations

import gc

from treadle import Engine
from treadle.core.loading.gc_freeze import YOUNG_COLLECTION_THRESHOLD, freeze_startup_objects, release_startup_objects


def test_freezing_raises_the_young_threshold_and_releasing_restores_it() -> None:
    release_startup_objects()  # an engine an earlier test left running froze and raised them already
    before = gc.get_threshold()
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, *before[1:])
        freeze_startup_objects()  # a second scheduler in the process: the saved settings stay the first ones
    finally:
        release_startup_objects()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_an_engine_runs_under_the_raised_threshold_and_shutdown_gives_the_old_one_back(tiny_llama_dir) -> None:
    release_startup_objects()
    before = gc.get_threshold()
    engine = Engine({"model": {"path": tiny_llama_dir}, "cache": {"max_total_tokens": 256}})
    try:
        assert gc.get_threshold()[0] == YOUNG_COLLECTION_THRESHOLD
        assert engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}).completion_tokens == 2
    finally:
        engine.shutdown()
    assert gc.get_threshold() == before
