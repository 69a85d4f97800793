"""Randomized scheduler workloads: arrivals over time, shared prefixes, chunked/mixed prefill, retraction
under a tiny pool, and aborts — with the overlapped loop (the default) and the synchronous one. Every request that is not aborted must produce exactly the greedy tokens it
produces alone, and no KV slot may leak."""

from __future__ import annotations

import random

import pytest

from treadle import Engine, SamplingParams
from treadle.core.request import Req
from treadle.testing.engine import assert_kv_accounted

# Pools far smaller than the workload and no decode reserve: retraction must happen.
CONFIGS = {
    "token-chunked": {"cache": {"max_total_tokens": 96},
                      "scheduler": {"chunked_prefill_size": 16, "new_token_ratio": 0.0}},
    "paged-mixed": {"cache": {"kv_allocator": "paged", "page_size": 4, "max_total_tokens": 112},
                    "scheduler": {"chunked_prefill_size": 12, "enable_mixed_chunk": True, "policy": "lpm",
                                  "new_token_ratio": 0.0}},
    "no-radix-dfs": {"cache": {"disable_radix_cache": True, "max_total_tokens": 96},
                     "scheduler": {"policy": "dfs-weight", "max_running_requests": 6, "new_token_ratio": 0.0}},
}


def _workload(seed: int) -> list[tuple[int, list[int], int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randint(8, 40))] for _ in range(3)]
    requests = []
    for i in range(14):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 12))]
        requests.append((rng.randint(0, 30), prompt, rng.randint(1, 24)))  # (arrival step, prompt, new tokens)
    return requests


@pytest.fixture(scope="module")
def solo_outputs(tiny_llama_dir):
    engine = Engine({"model": {"path": tiny_llama_dir}, "cache": {"max_total_tokens": 1024}})
    cache: dict[tuple, list[int]] = {}

    def solo(prompt: list[int], new_tokens: int) -> list[int]:
        key = (tuple(prompt), new_tokens)
        if key not in cache:
            params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
            cache[key] = engine.generate(input_ids=prompt, sampling_params=params).token_ids
        return cache[key]

    return solo


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_random_workload_matches_solo_runs_and_leaks_nothing(tiny_llama_dir, solo_outputs, config, seed, overlap):
    sections = {name: dict(values) for name, values in CONFIGS[config].items()}
    sections["scheduler"]["disable_overlap"] = not overlap
    engine = Engine({"model": {"path": tiny_llama_dir}, **sections})
    assert engine.scheduler.overlap is overlap
    scheduler = engine.scheduler
    workload = _workload(seed)
    rng = random.Random(seed + 100)
    aborted = {f"r{i}" for i in rng.sample(range(len(workload)), 3)}
    produced: dict[str, list[int]] = {f"r{i}": [] for i in range(len(workload))}
    finished: dict[str, str] = {}
    step = 0
    while len(finished) < len(workload):
        for i, (arrival, prompt, new_tokens) in enumerate(workload):
            if arrival == step:
                params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
                scheduler.add_request(Req(rid=f"r{i}", origin_input_ids=prompt, sampling_params=params))
        for rid in aborted:
            if rid not in finished and len(produced[rid]) >= 2:
                final = scheduler.abort_request(rid)
                if final is not None:
                    finished[rid] = final.finished_reason
        for output in scheduler.step():
            produced[output.rid].extend(output.new_token_ids)
            if output.finished_reason is not None:
                finished[output.rid] = output.finished_reason
        step += 1
        assert step < 2000, f"workload did not finish: {len(finished)}/{len(workload)} done"
    for i, (_, prompt, new_tokens) in enumerate(workload):
        rid = f"r{i}"
        if finished[rid] == "abort":
            continue
        assert finished[rid] == "length"
        assert produced[rid] == solo_outputs(prompt, new_tokens), rid
    assert scheduler.kv_stats()["retractions"] > 0
    assert_kv_accounted(engine)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_random_log_prob_requests_report_every_position_once_as_computed_alone(tiny_llama_dir, config):
    """Prompt and output log-probs under chunks, pages, retraction and shared prefixes: each position is reported
    once, with the value a request computed alone in a large pool gets. (Two bugs hid here: a chunk before
    ``logprob_start_len`` crashed the scheduler; a retracted request reported its prompt's log-probs again.)"""
    alone = Engine({"model": {"path": tiny_llama_dir}, "cache": {"max_total_tokens": 1024}})
    engine = Engine({"model": {"path": tiny_llama_dir}, **CONFIGS[config]})
    rng = random.Random(config)
    for _ in range(3):
        workload = _workload(rng.randrange(1000))[:8]
        prompts = [prompt for _, prompt, _ in workload]
        params = [SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
                  for _, _, new_tokens in workload]
        options = {"return_logprob": True, "logprob_start_len": rng.choice([0, 1, 9, 30]),
                   "top_logprobs_num": rng.choice([0, 2])}
        outputs = engine.generate(input_ids=prompts, sampling_params=params, **options)
        for out, prompt, param in zip(outputs, prompts, params):
            want = alone.generate(input_ids=prompt, sampling_params=param, **options)
            assert out.token_ids == want.token_ids
            assert len(out.output_token_logprobs) == len(out.token_ids)
            assert out.output_token_logprobs == pytest.approx(want.output_token_logprobs, abs=1e-4)
            start = options["logprob_start_len"]
            assert len(out.input_token_logprobs) == max(len(prompt) - start, 0) if start else len(prompt)
            assert out.input_token_logprobs == pytest.approx(want.input_token_logprobs, abs=1e-4)
            if options["top_logprobs_num"]:
                assert [[i for i, _ in top] for top in out.output_top_logprobs] == \
                    [[i for i, _ in top] for top in want.output_top_logprobs]
    assert engine.scheduler.kv_stats()["retractions"] > 0
    assert_kv_accounted(engine)
