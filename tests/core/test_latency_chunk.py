"""``scheduler.latency_chunk_size``: while a trickle of requests arrives, each step carries at most that many
prompt tokens mixed into the decode batch. Outputs stay what they are; only the batching changes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from batch_log import generate_logged

from treadle import Engine, SamplingParams
from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.scheduling.prefill import PrefillManager
from treadle.core.scheduling.state import SchedulerState
from treadle.testing.engine import assert_kv_accounted


def _decider(running: int, waiting_left: list[int], size: int = 8, chunk: int | None = 64,
             chunked_left: int | None = None) -> SimpleNamespace:
    def req(left: int) -> SimpleNamespace:
        return SimpleNamespace(seq_len=left + 5, kv_len=5)

    config = SimpleNamespace(scheduler=SimpleNamespace(latency_chunk_size=size, chunked_prefill_size=chunk,
                                                       max_prefill_tokens=100))
    state = SchedulerState(new_token_ratio=0.4, running=[object()] * running, waiting=[req(n) for n in waiting_left],
                           chunked_req=req(chunked_left) if chunked_left is not None else None)
    prefill = PrefillManager(config, state, memory=None, decode=None, policy=None, oom_backoff=None)
    return SimpleNamespace(chunk=prefill.latency_chunk)


def test_the_latency_chunk_applies_to_a_trickle_beside_a_small_decode_batch() -> None:
    assert _decider(running=3, waiting_left=[30]).chunk() == 8
    assert _decider(running=3, waiting_left=[], chunked_left=40).chunk() == 8
    # Nothing decoding: the prompt runs in full chunks (no stream to protect).
    assert _decider(running=0, waiting_left=[30]).chunk() == 0
    # As many decoding as the chunk size or more: a step of that many rows is no longer cheap.
    assert _decider(running=8, waiting_left=[30]).chunk() == 0
    # A backlog of more than one chunk (64) prefills in full chunks.
    assert _decider(running=3, waiting_left=[40, 30]).chunk() == 0
    assert _decider(running=3, waiting_left=[40], chunked_left=30).chunk() == 0
    # Without chunking the bound is max_prefill_tokens (100).
    assert _decider(running=3, waiting_left=[40, 30], chunk=None).chunk() == 8
    # Off.
    assert _decider(running=3, waiting_left=[30], size=0).chunk() == 0


PROMPTS = [[5 + i] + [17, 42, 8, 99, 3, 61, 12] * (2 + i % 3) for i in range(10)]
# Different lengths, so that running requests finish one by one and the waiting ones trickle in.
PARAMS = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 4, 12, 6, 8, 5, 10, 7, 4)]


def _describe(batch) -> tuple[str, int, int]:
    """(mode, prompt tokens, decode rows) of a launched batch."""
    prompt_tokens = sum(e.extend_len for e in batch.entries if not e.input_on_device)
    return batch.forward_mode.name, prompt_tokens, sum(e.input_on_device for e in batch.entries)


def _run(model_dir: str, latency_chunk: int, overlap: bool) -> tuple[list, list[tuple[str, int, int]], Engine]:
    scheduler = {"max_running_requests": 4, "chunked_prefill_size": 64, "latency_chunk_size": latency_chunk,
                 "disable_overlap": not overlap}
    return generate_logged(model_dir, scheduler, PROMPTS, PARAMS, _describe)


@pytest.mark.parametrize("overlap", [False, True])
def test_latency_chunks_ride_in_decode_steps_without_changing_outputs(tiny_llama_dir, overlap) -> None:
    plain, plain_steps, plain_engine = _run(tiny_llama_dir, latency_chunk=0, overlap=overlap)
    chunked, steps, engine = _run(tiny_llama_dir, latency_chunk=8, overlap=overlap)
    assert chunked == plain
    assert ForwardMode.MIXED.name not in {mode for mode, _, _ in plain_steps}
    mixed = [(tokens, rows) for mode, tokens, rows in steps if mode == ForwardMode.MIXED.name]
    assert mixed, f"waiting prompts that fit one chunk must ride in decode steps: {steps}"
    assert all(0 < tokens <= 8 and 0 < rows < 8 for tokens, rows in mixed), mixed
    # The initial backlog (10 prompts, > one chunk) still prefills in full chunks.
    assert steps[0][0] == ForwardMode.EXTEND.name and steps[0][1] > 8
    for e in (plain_engine, engine):
        assert_kv_accounted(e)
