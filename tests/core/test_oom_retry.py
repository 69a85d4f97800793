"""A device out-of-memory during a forward retracts the batch and retries smaller instead of crashing.

The OOM is injected on the CPU: the model worker's forward raises ``torch.cuda.OutOfMemoryError``
for batches over a size. Greedy outputs must equal a run without OOMs and every KV slot must come back.
"""

from __future__ import annotations

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.scheduling.oom import OomBackoff
from treadle.testing.engine import assert_kv_accounted

PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2, 150, 77, 45, 18, 6, 21, 22, 23],
           [5, 17, 42, 8, 99, 3, 250, 11, 200, 12], [300, 301, 9, 4, 4, 4], [400, 7, 7, 7, 9, 10, 11, 12, 13],
           [60, 61, 62], [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87, 88]]
GREEDY = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 5, 9, 3, 7, 10)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from treadle.testing.models import make_tiny_llama

    path = tmp_path_factory.mktemp("tiny-oom")
    make_tiny_llama(path)
    return str(path)


def _engine(model_dir: str, overlap: bool, paged: bool) -> Engine:
    cache = {"max_total_tokens": 1024, **({"kv_allocator": "paged", "page_size": 4} if paged else {})}
    return Engine({"model": {"path": model_dir}, "cache": cache,
                   "scheduler": {"disable_overlap": not overlap, "chunked_prefill_size": 64}})


def _inject_oom(engine: Engine, max_requests: int, max_tokens: int) -> list[tuple[int, int]]:
    """Make the worker's forward raise for batches over the limits; returns the (requests, tokens) of each OOM."""
    worker = engine.scheduler.worker
    forward = worker.forward
    ooms: list[tuple[int, int]] = []

    def limited(forward_batch):
        if forward_batch.batch_size > max_requests or forward_batch.input_ids.numel() > max_tokens:
            ooms.append((forward_batch.batch_size, int(forward_batch.input_ids.numel())))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return forward(forward_batch)

    worker.forward = limited
    return ooms


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap,paged", [(True, False), (False, False), (True, True)],
                         ids=["overlap", "sync", "overlap-paged"])
def test_oom_retries_smaller_with_identical_outputs(model_dir: str, overlap: bool, paged: bool) -> None:
    reference = _engine(model_dir, overlap, paged).generate(input_ids=PROMPTS, sampling_params=GREEDY)
    engine = _engine(model_dir, overlap, paged)
    ooms = _inject_oom(engine, max_requests=2, max_tokens=24)
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert ooms, "the injected OOM never fired"
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    assert [o.finish_reason for o in outputs] == ["length"] * len(PROMPTS)
    assert engine.kv_stats()["oom_retries"] == len(ooms)
    assert_kv_accounted(engine)


@pytest.mark.timeout(120)
def test_a_request_too_big_even_alone_is_aborted_and_the_rest_finish(model_dir: str) -> None:
    engine = _engine(model_dir, overlap=True, paged=False)
    _inject_oom(engine, max_requests=8, max_tokens=12)  # the 20-token prompt cannot run, even in chunks of 16
    outputs = engine.generate(input_ids=PROMPTS[:3], sampling_params=GREEDY[:3])
    assert outputs[0].finish_reason == "abort"
    assert [o.finish_reason for o in outputs[1:]] == ["length", "length"]
    assert_kv_accounted(engine)


def test_backoff_halves_then_relaxes() -> None:
    backoff = OomBackoff(relax_after=2)
    assert backoff.on_oom(ForwardMode.DECODE, 8, 8) and backoff.running_limit(64) == 4
    assert backoff.on_oom(ForwardMode.EXTEND, 1, 100) and backoff.prefill_budget(2048) == 50
    assert not backoff.on_oom(ForwardMode.DECODE, 1, 1)
    backoff.on_success()
    backoff.on_success()
    assert backoff.running_limit(64) == 8 and backoff.prefill_budget(2048) == 100
