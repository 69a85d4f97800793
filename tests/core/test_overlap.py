"""Overlap scheduling: the overlapped loop (tokens read one step late, decode inputs fed on the device)
produces exactly what the synchronous loop produces, under every policy and memory configuration,
and leaks no KV slot — including requests aborted or retracted with a step in flight."""

from __future__ import annotations

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.core.request import Req
from treadle.testing.engine import assert_kv_accounted

PROMPTS = [
    [5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2, 150, 77, 45, 18, 6],
    [5, 17, 42, 8, 99, 3, 250, 11, 200, 12],
    [300, 301, 9],
    [5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2, 150, 77, 45, 18, 6, 120, 121, 122, 123, 124],
    [400, 7, 7, 7, 9, 10, 11, 12, 13],
]
# Different lengths per request, so requests finish (and free memory) while others still run.
GREEDY = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (16, 5, 14, 2, 11)]

PAGED = {"kv_allocator": "paged", "page_size": 4}
CONFIGS = {
    "token": {},
    "paged4": {"cache": PAGED},
    "no-radix": {"cache": {"disable_radix_cache": True}},
    "chunked": {"scheduler": {"chunked_prefill_size": 5}},
    "paged-chunked-mixed": {"cache": PAGED, "scheduler": {"chunked_prefill_size": 6, "enable_mixed_chunk": True}},
    "retract-token": {"cache": {"max_total_tokens": 40}, "scheduler": {"new_token_ratio": 0.0}},
    "retract-paged-mixed": {"cache": {"max_total_tokens": 40, **PAGED},
                            "scheduler": {"new_token_ratio": 0.0, "chunked_prefill_size": 8,
                                          "enable_mixed_chunk": True}},
}
POLICIES = ["fcfs", "lpm", "random", "dfs-weight", "lof", "priority", "shortest-prompt-first"]


def make_engine(model_dir: str, overlap: bool, sections: dict) -> Engine:
    config = {"model": {"path": model_dir}, "cache": {"max_total_tokens": 2048},
              "scheduler": {"disable_overlap": not overlap}}
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return Engine(config)


def run_both(model_dir: str, sections: dict, **generate):
    """Outputs with overlap off and on (each engine checked for leaks), as comparable tuples."""
    results = []
    for overlap in (False, True):
        engine = make_engine(model_dir, overlap, sections)
        assert engine.scheduler.overlap is overlap
        outputs = engine.generate(**generate)
        results.append([(o.token_ids, o.finish_reason, o.matched_stop, o.output_token_logprobs,
                         o.input_token_logprobs, o.output_top_logprobs) for o in outputs])
        stats = engine.kv_stats()
        assert_kv_accounted(engine)
        results[-1].append(stats["retractions"] > 0)
    return results


@pytest.mark.parametrize("config", list(CONFIGS))
def test_overlap_matches_the_synchronous_loop(tiny_llama_dir, config):
    sync, overlapped = run_both(tiny_llama_dir, CONFIGS[config], input_ids=PROMPTS, sampling_params=GREEDY)
    assert overlapped == sync
    if config.startswith("retract"):
        assert overlapped[-1], "the tiny pool must force a retraction"


@pytest.mark.parametrize("policy", POLICIES)
def test_overlap_matches_under_every_policy(tiny_llama_dir, policy):
    sections = {"cache": PAGED, "scheduler": {"policy": policy, "max_running_requests": 2,
                                              "chunked_prefill_size": 8, "enable_mixed_chunk": True}}
    sync, overlapped = run_both(tiny_llama_dir, sections, input_ids=PROMPTS, sampling_params=GREEDY,
                                priority=[0, 3, 1, 2, 4])
    assert overlapped == sync


def test_sampling_state_stops_and_logprobs_match(tiny_llama_dir):
    """Seeds, penalties, stop tokens, max_new_tokens=0 and log-probs see the same history either way."""
    params = [
        SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True, repetition_penalty=1.9,
                       frequency_penalty=2.0, presence_penalty=1.0),
        SamplingParams(max_new_tokens=0),
        SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[]),
        SamplingParams(max_new_tokens=6, temperature=1.0, min_p=0.1, seed=3, ignore_eos=True,
                       frequency_penalty=1.5),
    ]
    sync, overlapped = run_both(tiny_llama_dir, {"scheduler": {"chunked_prefill_size": 6}}, input_ids=PROMPTS,
                                sampling_params=params, return_logprob=True, logprob_start_len=2,
                                top_logprobs_num=2)
    assert overlapped == sync
    # Stop tokens hit mid-batch finish requests one step before the overlapped loop notices; the
    # finished rows (one with penalties) still sit in the step in flight and are discarded.
    params[3] = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[sync[3][0][4]])
    params[1].stop_token_ids = [sync[1][0][5]]
    sync, overlapped = run_both(tiny_llama_dir, {}, input_ids=PROMPTS, sampling_params=params)
    assert overlapped == sync
    for i in (1, 3):
        assert sync[i][1] == "stop" and sync[i][0][-1] in params[i].stop_token_ids


def test_tokens_arrive_one_step_late_with_overlap(tiny_llama_dir):
    def first_outputs(overlap: bool) -> list[list[int]]:
        engine = make_engine(tiny_llama_dir, overlap, {})
        scheduler = engine.scheduler
        scheduler.add_request(Req(rid="a", origin_input_ids=PROMPTS[0], sampling_params=GREEDY[0]))
        steps = [[tok for out in scheduler.step() for tok in out.new_token_ids] for _ in range(3)]
        while scheduler.has_work():
            scheduler.step()
        assert_kv_accounted(engine)
        return steps

    sync, overlapped = first_outputs(False), first_outputs(True)
    assert [len(s) for s in sync] == [1, 1, 1]
    assert overlapped == [[], sync[0], sync[1]]


@pytest.mark.parametrize("config", ["token", "paged-chunked-mixed", "retract-paged-mixed"])
@pytest.mark.parametrize("when", [0, 1, 2, 4])
def test_abort_with_a_step_in_flight(tiny_llama_dir, config, when):
    """Abort after ``when`` steps (prefill, middle chunk or decode in flight): the others are unaffected."""
    results = []
    for overlap in (False, True):
        engine = make_engine(tiny_llama_dir, overlap, CONFIGS[config])
        scheduler = engine.scheduler
        for i, (prompt, params) in enumerate(zip(PROMPTS, GREEDY)):
            scheduler.add_request(Req(rid=f"r{i}", origin_input_ids=prompt, sampling_params=params))
        produced: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        reasons: dict[str, str] = {}
        for _ in range(when):
            for out in scheduler.step():
                produced[out.rid].extend(out.new_token_ids)
                if out.finished_reason:
                    reasons[out.rid] = out.finished_reason
        for rid in ("r0", "r3"):
            final = scheduler.abort_request(rid)
            if final is not None:
                reasons[rid] = final.finished_reason
        while scheduler.has_work():
            for out in scheduler.step():
                assert out.rid not in ("r0", "r3") or reasons.get(out.rid) != "abort", "output after abort"
                produced[out.rid].extend(out.new_token_ids)
                if out.finished_reason:
                    reasons[out.rid] = out.finished_reason
        assert_kv_accounted(engine)
        assert all(reasons[rid] == "length" for rid in ("r1", "r2", "r4"))
        results.append(produced)
    sync, overlapped = results
    assert [overlapped[rid] for rid in ("r1", "r2", "r4")] == [sync[rid] for rid in ("r1", "r2", "r4")]
    # The overlapped loop reads tokens one step later, so an abort may cut a request one token earlier.
    for rid in ("r0", "r3"):
        shorter, longer = sorted((overlapped[rid], sync[rid]), key=len)
        assert longer[:len(shorter)] == shorter and len(longer) - len(shorter) <= 1


def test_a_request_that_stops_in_flight_pays_one_discarded_step(tiny_llama_dir):
    reference = make_engine(tiny_llama_dir, False, {}).generate(input_ids=PROMPTS[0], sampling_params=GREEDY[0])
    stop_at = reference.token_ids[3]
    expected = reference.token_ids[: reference.token_ids.index(stop_at) + 1]
    engine = make_engine(tiny_llama_dir, True, {})
    scheduler = engine.scheduler
    req = Req(rid="a", origin_input_ids=PROMPTS[0], sampling_params=SamplingParams(
        max_new_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_at]))
    scheduler.add_request(req)
    scheduler.add_request(Req(rid="b", origin_input_ids=PROMPTS[1], sampling_params=GREEDY[0]))
    produced: list[int] = []
    while True:
        outputs = {out.rid: out for out in scheduler.step()}
        if "a" in outputs:
            produced.extend(outputs["a"].new_token_ids)
            if outputs["a"].finished_reason:
                break
    assert produced == expected and req.finished_reason == "stop"
    # The step in flight still computes a row for the finished request; its memory is already released.
    assert any(entry.req is req for entry in scheduler.inflight.batch.entries)
    assert req.req_pool_idx is None and req.kv_len == 0
    while scheduler.has_work():
        scheduler.step()
    assert req.output_ids == expected
    assert_kv_accounted(engine)


def test_token_owners_maps_every_token_to_its_run_and_offset() -> None:
    from treadle.core.scheduling.schedule_batch import token_owners

    owner, offset = token_owners([2, 0, 3, 1])
    assert owner.tolist() == [0, 0, 2, 2, 2, 3]
    assert offset.tolist() == [0, 1, 0, 1, 2, 0]
    assert owner.dtype == offset.dtype == torch.int64
    empty_owner, empty_offset = token_owners([])
    assert empty_owner.numel() == empty_offset.numel() == 0


def test_to_device_packed_gives_each_host_array_back_with_its_shape_and_values():
    import numpy as np

    from treadle.core.execution.overlap import to_device_packed

    arrays = [[7, 3], np.arange(6, dtype=np.int32).reshape(2, 3), torch.tensor([9, 8, 5]), np.empty(0, np.int64)]
    moved = to_device_packed(arrays, torch.device("cpu"))
    assert [tuple(t.shape) for t in moved] == [(2,), (2, 3), (3,), (0,)]
    assert all(t.dtype == torch.int64 for t in moved)
    assert [t.tolist() for t in moved] == [[7, 3], [[0, 1, 2], [3, 4, 5]], [9, 8, 5], []]


def test_pinned_staging_reuses_a_buffer_only_once_its_copy_finished(monkeypatch):
    """The ring's bookkeeping, with a stand-in for the CUDA copy and event (the CPU has neither)."""
    import numpy as np

    from treadle.core.execution import overlap

    class Event:
        done = False

        def query(self):
            return self.done

        def record(self, stream=None):
            self.done = False

    monkeypatch.setattr(torch, "empty", lambda size, dtype, pin_memory: torch.zeros(size, dtype=dtype))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: None)
    fresh = []
    monkeypatch.setattr(overlap, "to_device", lambda tensor, device: fresh.append(tensor.tolist()) or tensor)
    staging = overlap.PinnedStaging(torch.device("cpu"), buffers=2, size=4)
    first = staging.copy([np.array([1, 2]), np.array([3])])
    second = staging.copy([np.array([4])])
    assert first.tolist() == [1, 2, 3] and second.tolist() == [4] and fresh == []
    assert staging.copy([np.array([5])]).tolist() == [5] and fresh == [[5]]  # buffer 0's copy still running
    staging.events[0].done = True
    assert staging.copy([np.array([6, 7])]).tolist() == [6, 7] and staging.buffers[0][:2].tolist() == [6, 7]
    assert staging.copy([np.arange(5)]).tolist() == [0, 1, 2, 3, 4] and fresh[-1] == [0, 1, 2, 3, 4]  # too long
