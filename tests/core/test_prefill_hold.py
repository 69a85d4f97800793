"""``scheduler.prefill_hold_steps``: while the decode batch is large, a prefill of few tokens waits a few decode
steps for more requests to join it. Outputs stay what they are without holding; only the batching changes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from batch_log import generate_logged

from treadle import Engine, SamplingParams
from treadle.core.forward_batch import ForwardMode
from treadle.core.scheduler_batches import BatchBuilding
from treadle.testing.engine import assert_kv_accounted


def _decider(running: int, waiting_lens: list[int], held: int, hold_steps: int = 3, limit: int = 8,
             chunk: int | None = 64) -> SimpleNamespace:
    scheduler = SimpleNamespace(
        config=SimpleNamespace(scheduler=SimpleNamespace(
            max_running_requests=limit, prefill_hold_steps=hold_steps, chunked_prefill_size=chunk,
            max_prefill_tokens=100)),
        running=[object()] * running,
        waiting=[SimpleNamespace(seq_len=n) for n in waiting_lens],
        prefill_held_steps=held,
    )
    scheduler._chunk_tokens = lambda: BatchBuilding._chunk_tokens(scheduler)
    scheduler.hold = lambda: BatchBuilding._hold_prefill(scheduler)
    return scheduler


def test_a_small_prefill_waits_only_while_the_decode_batch_is_large_and_at_most_the_hold_steps() -> None:
    s = _decider(running=6, waiting_lens=[10, 10], held=0)
    assert s.hold() and s.prefill_held_steps == 1
    assert s.hold() and s.hold() and s.prefill_held_steps == 3
    assert not s.hold(), "after prefill_hold_steps decode steps the prefill runs"
    # Fewer running than half the limit: never held (the GPU has room, and latency matters more).
    assert not _decider(running=3, waiting_lens=[10], held=0).hold()
    # A full running batch: nothing could be admitted, so nothing is counted as held.
    full = _decider(running=8, waiting_lens=[10], held=0)
    assert not full.hold() and full.prefill_held_steps == 0
    # Holding off: never held.
    assert not _decider(running=6, waiting_lens=[10], held=0, hold_steps=0).hold()


def test_a_prefill_of_a_whole_chunk_runs_at_once() -> None:
    # Room for 2 requests; their prompts fill a 64-token chunk.
    assert not _decider(running=6, waiting_lens=[40, 30, 1], held=0).hold()
    # Only the prompts that fit in the room count: 2 x 10 tokens is less than a chunk.
    assert _decider(running=6, waiting_lens=[10, 10, 50], held=0).hold()
    # Without chunking the threshold is max_prefill_tokens (100).
    assert _decider(running=6, waiting_lens=[40, 40], held=0, chunk=None).hold()
    assert not _decider(running=6, waiting_lens=[60, 40], held=0, chunk=None).hold()


PROMPTS = [[5 + i, 17, 42, 8, 99 + i, 3] for i in range(10)]
# Different lengths, so that running requests finish one by one and make room for the waiting ones.
PARAMS = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 4, 12, 6, 8, 5, 10, 7, 4)]


def _run(model_dir: str, hold_steps: int, overlap: bool) -> tuple[list, list[str], Engine]:
    scheduler = {"max_running_requests": 4, "chunked_prefill_size": 64, "prefill_hold_steps": hold_steps,
                 "disable_overlap": not overlap}
    return generate_logged(model_dir, scheduler, PROMPTS, PARAMS, lambda batch: batch.forward_mode.name)


@pytest.mark.parametrize("overlap", [False, True])
def test_holding_batches_admissions_without_changing_outputs(tiny_llama_dir, overlap) -> None:
    eager, eager_modes, eager_engine = _run(tiny_llama_dir, hold_steps=0, overlap=overlap)
    held, held_modes, held_engine = _run(tiny_llama_dir, hold_steps=4, overlap=overlap)
    assert held == eager
    assert eager_engine.scheduler.config.scheduler.prefill_hold_steps == 0
    prefills = [modes.count(ForwardMode.EXTEND.name) for modes in (eager_modes, held_modes)]
    assert prefills[1] < prefills[0], f"holding must admit in fewer, fuller prefill steps: {prefills}"
    for engine in (eager_engine, held_engine):
        assert_kv_accounted(engine)
