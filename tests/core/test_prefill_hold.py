"""``scheduler.prefill_hold_steps``: while the decode batch is large, a prefill of few tokens waits a few decode
steps for more requests to join it. Outputs stay what they are without holding; only the batching changes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from batch_log import generate_logged

from treadle import Engine, SamplingParams
from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.scheduling.batch_building import BatchBuilding
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
    s = _decider(running=6, waiting_lens=[10, 10, 10], held=0)
    assert s.hold() and s.prefill_held_steps == 1
    assert s.hold() and s.hold() and s.prefill_held_steps == 3
    assert not s.hold(), "after prefill_hold_steps decode steps the prefill runs"
    # Fewer running than half the limit: never held (the GPU has room, and latency matters more).
    assert not _decider(running=3, waiting_lens=[10], held=0).hold()
    # A full running batch: nothing could be admitted, so nothing is counted as held.
    full = _decider(running=8, waiting_lens=[10], held=0)
    assert not full.hold() and full.prefill_held_steps == 0
    # Holding off: never held.
    assert not _decider(running=6, waiting_lens=[10, 10, 10], held=0, hold_steps=0).hold()
    # Every waiting request fits the room (2): more room would let no more in, so nothing waits.
    assert not _decider(running=6, waiting_lens=[10, 10], held=0).hold()


def test_a_prefill_of_a_whole_chunk_runs_at_once() -> None:
    # Room for 2 requests; their prompts fill a 64-token chunk.
    assert not _decider(running=6, waiting_lens=[40, 30, 1], held=0).hold()
    # Only the prompts that fit in the room count: 2 x 10 tokens is less than a chunk.
    assert _decider(running=6, waiting_lens=[10, 10, 50], held=0).hold()
    # Without chunking the threshold is max_prefill_tokens (100).
    assert _decider(running=6, waiting_lens=[40, 40, 40], held=0, chunk=None).hold()
    assert not _decider(running=6, waiting_lens=[60, 40, 40], held=0, chunk=None).hold()


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


def test_the_last_prompts_of_an_offline_batch_start_at_once(tiny_llama_dir) -> None:
    """16 prompts in chunks of 3 beside a decode batch over half the limit: the last prompt fits the room, so it is
    not held (a hold could gather no more), and the offline Engine's latency chunk is off (no streams to protect):
    the batch takes its prefill chunks plus its new tokens in steps, no more."""
    prompts = [[7 + i] + list(range(100, 115)) for i in range(16)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    scheduler = {"max_running_requests": 16, "chunked_prefill_size": 48, "enable_mixed_chunk": True,
                 "prefill_hold_steps": 8}
    outputs, modes, engine = generate_logged(tiny_llama_dir, scheduler, prompts, [params] * 16,
                                             lambda batch: batch.forward_mode.name)
    assert engine.scheduler.config.scheduler.latency_chunk_size == 0
    assert all(len(tokens) == 12 for tokens, _ in outputs)
    assert len(modes) <= 6 + 12, modes  # ceil(16 / 3) prefill steps, then the last prompt's 11 more decode steps
    assert_kv_accounted(engine)


def test_the_offline_engine_turns_the_latency_chunk_off_unless_it_is_set() -> None:
    from treadle.core.config import load_config
    from treadle.core.resolved_config import RuntimeFacts, resolve_config

    facts = RuntimeFacts(device="cuda", dtype="bfloat16", context_length=4096, kv_bytes_per_token=4096,
                         kv_dtype="bfloat16", device_total_bytes=80 * 1024**3, device_free_bytes=70 * 1024**3)
    for requested, resolved in (("auto", 0), (256, 256)):
        config = load_config(overrides={"scheduler.latency_chunk_size": requested,
                                        "scheduler.chunked_prefill_size": 1024}, use_env=False)
        offline = resolve_config(config, RuntimeFacts(**{**facts.__dict__, "offline": True}))
        assert offline.scheduler.latency_chunk_size == resolved
        assert resolve_config(config, facts).scheduler.latency_chunk_size == (256 if requested == 256 else 512)
