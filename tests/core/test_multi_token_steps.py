"""Decode steps of several tokens per request: a speculative worker (here an oracle that drafts from a plain run's
continuation, wrong at chosen positions) makes the scheduler build TARGET_VERIFY batches of k + 1 tokens per
request, append each request's accepted drafts and the target's next token through the usual stop checks, and give
back the rejected positions' KV. Greedy outputs are the plain run's token for token, for k = 1..4, overlap on and
off, with and without the radix cache, with the paged allocator, under memory pressure, OOM and aborts; every KV
slot comes back after each run."""

from __future__ import annotations

import time

import pytest
import torch

from oracle_speculator import OracleSpeculator
from treadle import Engine, SamplingParams
from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.request import Req
from treadle.core.scheduling.observers import StepObserver
from treadle.core.scheduling.scheduler import Scheduler
from treadle.testing.engine import assert_kv_accounted

PROMPTS = [
    [5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2, 150, 77, 45, 18, 6],
    [5, 17, 42, 8, 99, 3, 250, 11, 200, 12],  # shares its first 8 tokens with the first
    [300, 301, 9],
    [5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2, 150, 77, 45, 18, 6, 120, 121, 122, 123, 124],
    [400, 7, 7, 7, 9, 10, 11, 12, 13],
    [60, 61, 62, 63],
]
BUDGETS = (24, 5, 17, 2, 11, 30)  # requests finish (and free memory) while others still run
GREEDY = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in BUDGETS]
PAGED = {"kv_allocator": "paged", "page_size": 4}
MEMORY = {
    "token": {},
    "paged4": {"cache": PAGED},
    "no-radix": {"cache": {"disable_radix_cache": True}},
    "paged-chunked-mixed": {"cache": PAGED, "scheduler": {"chunked_prefill_size": 6, "enable_mixed_chunk": True}},
}


def make_engine(model_dir: str, overlap: bool = True, sections: dict | None = None) -> Engine:
    config = {"model": {"path": model_dir}, "cache": {"max_total_tokens": 2048},
              "scheduler": {"disable_overlap": not overlap}, "speculative": {"max_batch_size": 64}}
    for section, values in (sections or {}).items():
        config.setdefault(section, {}).update(values)
    return Engine(config)


def speculative(engine: Engine, k: int, references: dict, wrong: str = "random", seed: int = 0) -> OracleSpeculator:
    """Put an OracleSpeculator around ``engine``'s model worker and a scheduler over it."""
    worker = OracleSpeculator(engine.scheduler.worker, k, references, wrong=wrong, seed=seed)
    engine.scheduler = Scheduler(engine.config, engine.scheduler.registry, worker=worker)
    return worker


def plain_outputs(model_dir: str, sections: dict | None = None, prompts=PROMPTS, params=GREEDY, **generate):
    engine = make_engine(model_dir, True, sections)
    outputs = engine.generate(input_ids=prompts, sampling_params=params, **generate)
    assert_kv_accounted(engine)
    return outputs


def references(prompts, outputs) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): o.token_ids for p, o in zip(prompts, outputs)}


def summary(outputs) -> list[tuple]:
    return [(o.token_ids, o.finish_reason, o.matched_stop) for o in outputs]


@pytest.fixture(scope="module")
def plain_runs(tiny_llama_dir):
    cache: dict[str, list] = {}

    def run(memory: str):
        if memory not in cache:
            cache[memory] = plain_outputs(tiny_llama_dir, MEMORY[memory])
        return cache[memory]

    return run


@pytest.mark.parametrize("memory", list(MEMORY))
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_verify_steps_give_the_plain_runs_tokens(tiny_llama_dir, plain_runs, k, overlap, memory):
    plain = plain_runs(memory)
    engine = make_engine(tiny_llama_dir, overlap, MEMORY[memory])
    worker = speculative(engine, k, references(PROMPTS, plain), seed=k)
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert summary(outputs) == summary(plain)
    accepted = worker.accepted_counts()
    assert set(accepted) == set(range(k + 1)), "acceptance must vary from none to every draft"
    # Fewer steps than tokens: the accepted drafts were appended, not recomputed.
    assert len(worker.batches) < sum(len(o.token_ids) for o in outputs)
    assert_kv_accounted(engine, flush=False)
    # Continue each request from half its output, on the prefix cache the first run left: KV that verify steps
    # wrote (the accepted drafts' included) is read back.
    cuts = [len(o.token_ids) // 2 for o in plain]
    prompts = [p + o.token_ids[:cut] for p, o, cut in zip(PROMPTS, plain, cuts)]
    worker.references.update({tuple(p): o.token_ids[cut:] for p, o, cut in zip(prompts, plain, cuts)})
    params = [SamplingParams(max_new_tokens=n - cut, temperature=0.0, ignore_eos=True) for n, cut in zip(BUDGETS, cuts)]
    cached = engine.kv_stats()["cached_tokens_total"]
    again = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in again] == [o.token_ids[cut:] for o, cut in zip(plain, cuts)]
    if engine.scheduler.memory.caches_prefixes:
        assert engine.kv_stats()["cached_tokens_total"] - cached > sum(len(p) for p in PROMPTS)
    assert_kv_accounted(engine)


def hf_continuations(model_dir: str, prompts: list[list[int]], count: int) -> list[list[int]]:
    """HF's greedy next ``count`` tokens of each prompt, one full forward per token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    continuations = []
    with torch.no_grad():
        for prompt in prompts:
            sequence = list(prompt)
            for _ in range(count):
                sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
            continuations.append(sequence[len(prompt):])
    return continuations


def test_verify_steps_match_hf(tiny_llama_dir):
    prompts, budget = PROMPTS[:3], 14
    hf = hf_continuations(tiny_llama_dir, prompts, budget)
    engine = make_engine(tiny_llama_dir, True, {"cache": PAGED})
    worker = speculative(engine, 3, {tuple(p): ids for p, ids in zip(prompts, hf)})
    params = SamplingParams(max_new_tokens=budget, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)] == hf
    assert max(worker.accepted_counts()) == 3
    assert_kv_accounted(engine)


def test_a_plain_worker_still_decodes_one_token_per_request(tiny_llama_dir):
    class Batches(StepObserver):
        def __init__(self) -> None:
            self.seen: list[tuple[ForwardMode, list[int]]] = []

        def batch_built(self, batch) -> None:
            if batch is not None:
                self.seen.append((batch.forward_mode, [e.extend_len for e in batch.entries]))

    engine = make_engine(tiny_llama_dir)
    assert engine.scheduler.worker.decode_tokens_per_req == 1 and engine.scheduler.decode_tokens_per_req == 1
    batches = Batches()
    engine.scheduler.add_observer(batches)
    engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    decodes = [lens for mode, lens in batches.seen if mode is not ForwardMode.EXTEND]
    assert decodes and all(mode is ForwardMode.DECODE for mode, _ in batches.seen if mode is not ForwardMode.EXTEND)
    assert all(set(lens) == {1} for lens in decodes)
    assert_kv_accounted(engine)


def ends_inside_a_step(worker: OracleSpeculator, prompt: list[int], output) -> bool:
    """Whether ``output``'s last token came from a verify step that had accepted tokens past it."""
    last = len(prompt) + len(output.token_ids) - 1  # its position; a row makes start + 1 .. start + kept + 1
    return any(p == tuple(prompt) and start < last < start + kept + 1 for p, start, _, kept in worker.verified_rows())


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_stops_inside_an_accepted_run_drop_the_rest_of_the_step(tiny_llama_dir, plain_runs, overlap):
    """Stop token ids and max_new_tokens land in the middle of a step whose drafts were all accepted: the request
    ends there, as in the plain run, and the KV of the positions past it comes back (paged: page-aware)."""
    plain = plain_runs("paged4")
    stop_at = {0: 9, 2: 6, 4: 4}  # request -> output index of its stop token
    params = [SamplingParams(**vars(p)) for p in GREEDY]
    for i, index in stop_at.items():
        params[i].stop_token_ids = [plain[i].token_ids[index]]
    params[5].max_new_tokens = 13
    expected = plain_outputs(tiny_llama_dir, MEMORY["paged4"], params=params)
    assert [o.finish_reason for o in expected] == ["stop", "length", "stop", "length", "stop", "length"]
    engine = make_engine(tiny_llama_dir, overlap, MEMORY["paged4"])
    worker = speculative(engine, 4, references(PROMPTS, plain), wrong="never")
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert summary(outputs) == summary(expected)
    # Requests 0, 2, 4 stopped on a token and 1, 3 at max_new_tokens with accepted tokens left in their step.
    assert [ends_inside_a_step(worker, p, o) for p, o in zip(PROMPTS, outputs)][:5] == [True] * 5
    assert_kv_accounted(engine)


def test_stop_strings_inside_an_accepted_run(tiny_llama_text_dir):
    text_model_dir = tiny_llama_text_dir
    prompts = [[5, 17, 42, 8, 99, 3], [300, 301, 9, 10], [70, 71, 72, 73, 74]]
    params = [SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True) for _ in prompts]
    plain = plain_outputs(text_model_dir, prompts=prompts, params=params)
    engine = make_engine(text_model_dir)
    tokenizer = engine.tokenizer
    for i, p in enumerate(params):  # a stop string made of two tokens in the middle of the plain output
        p.stop = [tokenizer.decode(plain[i].token_ids[7 + i:9 + i])]
    expected = plain_outputs(text_model_dir, prompts=prompts, params=params)
    assert all(o.finish_reason == "stop" and o.matched_stop in params[i].stop for i, o in enumerate(expected))
    worker = speculative(engine, 4, references(prompts, plain), wrong="never")
    outputs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [(o.text, *s) for o, s in zip(outputs, summary(outputs))] == [
        (o.text, *s) for o, s in zip(expected, summary(expected))]
    assert any(ends_inside_a_step(worker, p, o) for p, o in zip(prompts, outputs))
    assert_kv_accounted(engine)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_log_probs_cover_every_appended_token(tiny_llama_dir, plain_runs, overlap):
    logprobs = dict(return_logprob=True, top_logprobs_num=3, logprob_start_len=1)
    expected = plain_outputs(tiny_llama_dir, **logprobs)
    engine = make_engine(tiny_llama_dir, overlap)
    speculative(engine, 3, references(PROMPTS, plain_runs("token")))
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, **logprobs)
    assert summary(outputs) == summary(expected)
    for got, want in zip(outputs, expected):
        assert len(got.output_token_logprobs) == len(got.token_ids) == len(got.output_top_logprobs)
        torch.testing.assert_close(got.output_token_logprobs, want.output_token_logprobs, atol=1e-4, rtol=1e-4)
        assert [[t for t, _ in top] for top in got.output_top_logprobs] == [
            [t for t, _ in top] for top in want.output_top_logprobs]
        assert got.input_token_logprobs == pytest.approx(want.input_token_logprobs, abs=1e-4)
    assert_kv_accounted(engine)


PRESSURE = {
    "retract-token": {"cache": {"max_total_tokens": 48}, "scheduler": {"new_token_ratio": 0.0}},
    "retract-paged": {"cache": {"max_total_tokens": 48, **PAGED}, "scheduler": {"new_token_ratio": 0.0}},
}


@pytest.mark.parametrize("memory", list(PRESSURE))
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("k", [2, 4])
def test_memory_pressure_retracts_and_recomputes(tiny_llama_dir, plain_runs, k, overlap, memory):
    plain = plain_runs("token")
    engine = make_engine(tiny_llama_dir, overlap, PRESSURE[memory])
    speculative(engine, k, references(PROMPTS, plain), seed=k)
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert summary(outputs) == summary(plain)
    assert engine.kv_stats()["retractions"] > 0, "the small pool must force a retraction"
    assert_kv_accounted(engine)


@pytest.mark.parametrize("memory", ["token", "paged4"])
def test_an_abort_with_a_verify_step_in_flight(tiny_llama_dir, plain_runs, memory):
    plain = plain_runs(memory)
    engine = make_engine(tiny_llama_dir, True, MEMORY[memory])
    speculative(engine, 3, references(PROMPTS, plain))
    scheduler = engine.scheduler
    for i, prompt in enumerate(PROMPTS):
        scheduler.add_request(Req(rid=f"r{i}", origin_input_ids=prompt, sampling_params=SamplingParams(**vars(GREEDY[i]))))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    finished: dict[str, str] = {}
    aborted = False
    while scheduler.has_work():
        for output in scheduler.step():
            tokens[output.rid].extend(output.new_token_ids)
            if output.finished_reason:
                finished[output.rid] = output.finished_reason
        inflight = scheduler.inflight
        if not aborted and inflight is not None and inflight.batch.forward_mode is ForwardMode.TARGET_VERIFY \
                and len(tokens["r0"]) >= 3:
            assert any(e.req.rid == "r0" for e in inflight.batch.entries)
            finished["r0"] = scheduler.abort_request("r0").finished_reason
            aborted = True
    assert aborted and finished["r0"] == "abort"
    assert tokens["r0"] == plain[0].token_ids[:len(tokens["r0"])] and len(tokens["r0"]) < BUDGETS[0]
    assert [tokens[f"r{i}"] for i in range(1, len(PROMPTS))] == [o.token_ids for o in plain[1:]]
    assert_kv_accounted(engine)


def test_a_verify_batch_out_of_device_memory_is_retried_smaller(tiny_llama_dir, plain_runs):
    plain = plain_runs("paged4")
    engine = make_engine(tiny_llama_dir, True, MEMORY["paged4"])
    worker = speculative(engine, 3, references(PROMPTS, plain))
    model_worker, forward = worker.inner, worker.inner.forward
    ooms: list[ForwardMode] = []

    def limited(forward_batch):
        if forward_batch.forward_mode is ForwardMode.TARGET_VERIFY and forward_batch.batch_size > 2:
            ooms.append(forward_batch.forward_mode)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return forward(forward_batch)

    model_worker.forward = limited
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert ooms
    assert summary(outputs) == summary(plain)
    assert engine.kv_stats()["oom_retries"] == len(ooms)
    assert_kv_accounted(engine)


def test_the_context_length_bounds_a_steps_positions(tiny_llama_dir):
    """A request that reaches the context length (512) ends there as in the plain run: steps never compute a
    position past it (fewer drafts for the whole batch near the end)."""
    long_prompt = [(7 * i) % 500 + 3 for i in range(499)]
    prompts = [long_prompt, PROMPTS[2]]
    params = [SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True), GREEDY[5]]
    plain = plain_outputs(tiny_llama_dir, prompts=prompts, params=params)
    assert len(plain[0].token_ids) == 13 and plain[0].finish_reason == "length"
    engine = make_engine(tiny_llama_dir)
    worker = speculative(engine, 4, references(prompts, plain), wrong="never")
    outputs = engine.generate(input_ids=prompts, sampling_params=params)
    assert summary(outputs) == summary(plain)
    rows = worker.verified_rows()
    # The last token a row computes is at start + tokens - 1; the token it predicts must be inside the context.
    assert max(start + tokens for p, start, tokens, _ in rows if p == tuple(long_prompt)) == 511
    assert any(t < 5 for mode, bs, t in worker.batches if mode == "TARGET_VERIFY" and bs == 2)
    assert_kv_accounted(engine)


def test_penalties_decode_one_token_at_a_time(tiny_llama_dir, plain_runs):
    """A request with penalties runs in plain decode steps (its token counts at a draft's position would depend on
    the drafts): the batch verifies nothing while it runs, and everything equals the plain run."""
    params = [SamplingParams(**vars(p)) for p in GREEDY]
    params[1].repetition_penalty, params[1].max_new_tokens = 1.5, 8
    expected = plain_outputs(tiny_llama_dir, params=params)
    engine = make_engine(tiny_llama_dir)
    worker = speculative(engine, 3, references(PROMPTS, plain_runs("token")))
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert summary(outputs) == summary(expected)
    assert not any(p == tuple(PROMPTS[1]) for p, _, _, _ in worker.verified_rows())
    modes = {mode for mode, _, _ in worker.batches}
    assert {"DECODE", "TARGET_VERIFY"} <= modes
    assert_kv_accounted(engine)


def test_seeded_sampling_gives_the_plain_runs_tokens(tiny_llama_dir):
    """A verify step samples position j as the request's output position len(output_ids) + j, with the same seed:
    the target keeps a draft exactly when plain decoding would have sampled it."""
    params = [SamplingParams(max_new_tokens=n, temperature=0.9, top_p=0.95, seed=10 + n, ignore_eos=True)
              for n in BUDGETS]
    plain = plain_outputs(tiny_llama_dir, params=params)
    engine = make_engine(tiny_llama_dir)
    worker = speculative(engine, 3, references(PROMPTS, plain))
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert summary(outputs) == summary(plain)
    assert max(worker.accepted_counts()) == 3
    assert_kv_accounted(engine)


def test_the_step_timer_counts_a_verify_steps_wait_as_settle_time(tiny_llama_dir, plain_runs):
    """A verify step in flight is waited for before the next batch is built: the timer counts that wait in the
    step's settle time, not in its build time."""
    from treadle.core.scheduling.step_timer import StepTimer

    class SlowResults:  # a device that takes 50 ms to deliver a verify step's results
        def __init__(self, results) -> None:
            self.results, self.slept = results, False

        def wait(self):
            if not self.slept:
                time.sleep(0.05)
                self.slept = True
            return self.results.wait()

    engine = make_engine(tiny_llama_dir)
    worker = speculative(engine, 3, references(PROMPTS, plain_runs("token")))
    sample = worker.launch_sampling

    def slow_sampling(step, *args):
        sample(step, *args)
        if step.batch.forward_mode is ForwardMode.TARGET_VERIFY:
            step.results = SlowResults(step.results)

    worker.launch_sampling = slow_sampling
    timer = StepTimer(torch.device("cpu"))
    engine.scheduler.add_observer(timer)
    engine.generate(input_ids=PROMPTS[:3], sampling_params=GREEDY[:3])
    after_verify = [step for before, step in zip(timer.steps, timer.steps[1:]) if before.get("mode") == "TARGET_VERIFY"]
    assert after_verify and all(step["settle"] >= 0.05 > step["build"] for step in after_verify)
    assert_kv_accounted(engine)
