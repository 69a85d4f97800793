"""The ``ngram`` speculator through the Engine: greedy output equals the plain run's token for token (tiny Llama,
Qwen3 and Mixtral; torch_native, and triton under the interpreter in a fresh process; both allocators; overlap on
and off; radix-cache hits; retraction under a small KV pool), drafts are accepted on repetitive text, and every KV
slot comes back. Its look-up itself: the longest, latest match, and rows whose newest tokens the host has not
seen yet."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

def test_max_drafts_says_how_many_are_worth_verifying():
    """Before a decode batch is built: 0 when no request repeats itself (the step decodes one token each), else the
    longest continuation found, at most num_draft_tokens."""
    speculator = NgramSpeculator(4, 1, 3, torch.device("cpu"))
    fresh = _Req("a", [10, 11, 12, 13], [14])
    fresh.kv_len = 4  # its last token (14) sits at position 4
    assert speculator.max_drafts([fresh]) == 0
    near_end = _Req("b", [1, 2, 3, 7, 8, 1, 2], [3])
    near_end.kv_len = 7  # "1 2 3" was followed by 7 8 1 2 3 only
    assert speculator.max_drafts([fresh, near_end]) == 4
    short = _Req("c", [5, 6, 9, 5], [6])
    short.kv_len = 4  # "5 6" was followed by 9 5 6: three tokens
    assert speculator.max_drafts([fresh, short]) == 3


def test_proposals_reuse_the_look_up_of_max_drafts_only_for_the_same_sequence():
    speculator = NgramSpeculator(4, 1, 3, torch.device("cpu"))
    req = _Req("b", [1, 2, 3, 7, 8, 1, 2], [3])
    req.kv_len = 7
    batch = SimpleNamespace(entries=[SimpleNamespace(req=req, kv_start=7)])
    assert speculator.max_drafts([req]) == 4
    assert speculator.propose(batch, 2).token_ids.tolist() == [[7, 8]]  # "1 2 3" -> 7 8 1 2, cut to 2
    assert speculator.max_drafts([req]) == 4
    req.output_ids.append(7)  # the sequence moved on after the look-up: "2 3 7" -> 8 1 2 3, not the stale 7 8
    req.kv_len = batch.entries[0].kv_start = 8
    assert speculator.propose(batch, 4).token_ids.tolist() == [[8, 1, 2, 3]]


def test_a_batch_with_nothing_to_copy_decodes_one_token_at_a_time(tiny_llama_dir):
    engine = Engine(config(tiny_llama_dir, True))
    batches = []
    engine.scheduler.add_observer(type("Modes", (StepObserver,), {
        "batch_built": lambda self, batch: batches.append(batch.forward_mode.name if batch else None)})())
    prompt = list(range(100, 140))  # no repeats, and 2 new tokens: nothing to look up
    output = engine.generate(input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=2, temperature=0.0))
    assert output.spec_verify_steps == 0 and "TARGET_VERIFY" not in batches and "DECODE" in batches
    assert_kv_accounted(engine)


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.core.scheduling.observers import StepObserver
from treadle.core.speculative.history import RowTokens
from treadle.core.speculative.worker import SpeculativeWorker
from treadle.plugins.speculators.ngram import NgramSpeculator
from treadle.testing.engine import assert_kv_accounted

NGRAM = "treadle.plugins.speculators.ngram"
PROMPTS = [
    [5, 17, 42, 8, 99, 3, 250, 11, 5, 17, 42, 8, 99, 3, 250, 11, 5, 17],  # a repeated phrase
    [5, 17, 42, 8, 99, 3, 250, 11, 200, 12],  # shares a prefix with the first
    [300, 301, 9],
    [60, 61, 62, 63, 60, 61, 62, 63, 60, 61],
]
BUDGETS = (26, 9, 21, 15)
GREEDY = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in BUDGETS]
MEMORY = {
    "token": {},
    "paged4": {"cache": {"kv_allocator": "paged", "page_size": 4}},
    "no-radix": {"cache": {"disable_radix_cache": True}},
    "chunked-mixed": {"scheduler": {"chunked_prefill_size": 6, "enable_mixed_chunk": True}},
    "retract": {"cache": {"max_total_tokens": 48}, "scheduler": {"new_token_ratio": 0.0}},
}


def config(model_dir: str, speculative: bool, overlap: bool = True, memory: str = "token", max_batch_size: int = 8,
           **extra) -> dict:
    values = {"model": {"path": model_dir}, "cache": {"max_total_tokens": 2048},
              "scheduler": {"disable_overlap": not overlap}, "plugins": [NGRAM], **extra}
    for section, keys in MEMORY[memory].items():
        values.setdefault(section, {}).update(keys)
    if speculative:
        values["speculative"] = {"method": "ngram", "num_tokens": 3, "max_batch_size": max_batch_size}
    return values


def run(model_dir: str, speculative: bool, prompts=PROMPTS, params=GREEDY, **kw):
    engine = Engine(config(model_dir, speculative, **kw))
    outputs = engine.generate(input_ids=prompts, sampling_params=params)
    return engine, outputs


def summary(outputs) -> list[tuple]:
    return [(o.token_ids, o.finish_reason) for o in outputs]


@pytest.fixture(scope="module")
def plain_runs(tiny_llama_dir):
    cache: dict[str, list] = {}

    def outputs(memory: str = "token") -> list:
        if memory not in cache:
            engine, cache[memory] = run(tiny_llama_dir, False, memory=memory)
            assert_kv_accounted(engine)
        return cache[memory]

    return outputs


@pytest.fixture(scope="module")
def plain(plain_runs):
    return plain_runs()


@pytest.mark.parametrize("memory", list(MEMORY))
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_greedy_output_is_the_plain_runs(tiny_llama_dir, plain_runs, overlap, memory):
    plain = plain_runs(memory)
    engine, outputs = run(tiny_llama_dir, True, overlap=overlap, memory=memory)
    assert isinstance(engine.scheduler.worker, SpeculativeWorker)
    assert summary(outputs) == summary(plain)
    steps = sum(o.spec_verify_steps for o in outputs)
    assert 0 < steps < sum(o.completion_tokens for o in outputs) - len(outputs), "drafts must be accepted"
    if memory == "retract":
        assert engine.kv_stats()["retractions"] > 0, "the small pool must force a retraction"
    assert_kv_accounted(engine, flush=False)
    if memory in ("token", "paged4"):  # again from half of each output, on what the first run cached
        cuts = [len(o.token_ids) // 2 for o in plain]
        prompts = [p + o.token_ids[:cut] for p, o, cut in zip(PROMPTS, plain, cuts)]
        params = [SamplingParams(max_new_tokens=n - cut, temperature=0.0, ignore_eos=True)
                  for n, cut in zip(BUDGETS, cuts)]
        cached = engine.kv_stats()["cached_tokens_total"]
        again = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in again] == [o.token_ids[cut:] for o, cut in zip(plain, cuts)]
        assert engine.kv_stats()["cached_tokens_total"] - cached > sum(len(p) for p in PROMPTS)
    assert_kv_accounted(engine)


@pytest.mark.parametrize("family", ["qwen3", "mixtral"])
def test_greedy_parity_on_other_families(tmp_path, family):
    from treadle.testing import models

    model_dir = getattr(models, f"make_tiny_{family}")(tmp_path)
    _, expected = run(model_dir, False)
    engine, outputs = run(model_dir, True)
    assert summary(outputs) == summary(expected)
    assert sum(o.spec_verify_steps for o in outputs) > 0
    assert_kv_accounted(engine)


def test_without_a_method_the_worker_is_the_plain_one(tiny_llama_dir):
    from treadle.core.execution.worker import ModelWorker

    engine, outputs = run(tiny_llama_dir, False, prompts=PROMPTS[:1], params=GREEDY[:1])
    assert type(engine.scheduler.worker) is ModelWorker and engine.scheduler.decode_tokens_per_req == 1
    assert outputs[0].spec_verify_steps == 0


def test_more_requests_than_max_batch_size_decode_one_token_each(tiny_llama_dir, plain):
    engine = Engine(config(tiny_llama_dir, True, max_batch_size=3))
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert summary(outputs) == summary(plain)
    # Request 1 finishes first (9 tokens): the three left verify; with four running, nobody did.
    assert outputs[1].spec_verify_steps == 0 and outputs[0].spec_verify_steps > 0
    assert_kv_accounted(engine)


def test_triton_interpreted(tiny_llama_dir, plain):
    """The same tokens with the triton backend's kernels (interpreted, in a fresh process) verifying the drafts."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, tiny_llama_dir], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    tokens, steps = proc.stdout.split()[-2:]
    assert tokens == ",".join(map(str, plain[0].token_ids[:TRITON_TOKENS])) and int(steps) > 0


# ------------------------------------------------------------------ the look-up


class _Req:
    def __init__(self, rid: str, prompt: list[int], output: list[int]) -> None:
        self.rid, self.origin_input_ids, self.output_ids = rid, prompt, output


def drafts(speculator: NgramSpeculator, req: _Req, unread=(), missing: int = 0, n: int = 3) -> list[int]:
    return speculator._drafts(req, RowTokens(list(unread), missing), n)


def test_the_longest_latest_match_proposes_what_followed_it():
    speculator = NgramSpeculator(3, 1, 3, torch.device("cpu"))
    # "1 2 3" occurs twice (followed by 4 5 6, then by 7 8 9): the latest wins; "3" alone is followed by 7 too.
    req = _Req("a", [1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 7, 8, 9, 0, 1, 2, 3], [])
    assert drafts(speculator, req) == [7, 8, 9]
    # One more token: "2 3 7" is a 3-gram seen once, followed by 8 9 0.
    req.output_ids.append(7)
    assert drafts(speculator, req) == [8, 9, 0]
    # A two-token suffix with no 3-gram match falls back to the longest shorter one.
    other = _Req("b", [4, 4, 1, 2, 9, 9, 5, 1, 2], [])
    assert drafts(speculator, other) == [9, 9, 5]
    # Nothing matches: the last token repeated (any proposal is verified).
    assert drafts(speculator, _Req("c", [10, 11, 12], [])) == [12, 12, 12]


def test_unread_and_unseen_tokens_shift_the_proposal():
    speculator = NgramSpeculator(3, 2, 2, torch.device("cpu"))
    req = _Req("a", [1, 2, 3, 4, 5, 6, 1, 2], [])
    # Tokens sampled but not appended yet (the previous verify step's) extend the suffix: "2 3" -> 4 5 6.
    assert drafts(speculator, req, unread=[3]) == [4, 5, 6]
    # The row's last token is not on the host (a prefill in flight): "1 2" -> 3 stands for it, 4 5 6 are drafts.
    assert drafts(speculator, req, missing=1) == [4, 5, 6]
    speculator.request_released(req)
    speculator.request_released(req)  # idempotent
    assert "a" not in speculator._indexes


TRITON_TOKENS = 10

if __name__ == "__main__":
    model_dir = sys.argv[1]
    extra = {"attention": {"backend": "triton"}, "model": {"path": model_dir, "device": "cpu", "dtype": "float32"}}
    engine = Engine({**config(model_dir, True), **extra})
    params = SamplingParams(max_new_tokens=TRITON_TOKENS, temperature=0.0, ignore_eos=True)
    output = engine.generate(input_ids=PROMPTS[:1], sampling_params=params)[0]
    assert_kv_accounted(engine)
    print(",".join(map(str, output.token_ids)), output.spec_verify_steps)


def test_a_long_prompt_indexed_at_once_finds_what_token_by_token_indexing_finds():
    import random

    generator = random.Random(0)
    prompt = [generator.randrange(50) for _ in range(300)]  # a small vocabulary: many repeated n-grams
    bulk, stepwise = NgramSpeculator(4, 1, 4, torch.device("cpu")), NgramSpeculator(4, 1, 4, torch.device("cpu"))
    drafts(bulk, _Req("a", prompt, []))
    growing = _Req("a", prompt[:1], [])
    for token in prompt[1:]:  # the same tokens arriving one a step, as outputs
        growing.output_ids.append(token)
        drafts(stepwise, growing)
    assert bulk._indexes["a"].tokens == stepwise._indexes["a"].tokens == prompt
    assert bulk._indexes["a"].latest.keys() == stepwise._indexes["a"].latest.keys()
    assert all(bulk._indexes["a"].latest[n] == stepwise._indexes["a"].latest[n] for n in range(1, 5))


def test_a_tree_branches_at_each_earlier_continuation():
    """topk 2: "1 2 3" was followed by 4 5 6, later by 7 8 9; both continuations branch from the root, grown a depth
    at a time; continuations that agree share their nodes, and a short tree is padded by a chain."""
    speculator = NgramSpeculator(4, 1, 3, torch.device("cpu"), topk=2)
    req = _Req("a", [1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 7, 8, 9, 0, 1, 2, 3], [])
    assert speculator._tree(req, RowTokens([], 0), 4) == ([7, 4, 8, 5], [-1, -1, 0, 1])
    same = _Req("b", [1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 6, 0, 1, 2, 3], [])  # 4 5 0 and 4 6 0 share their 4
    assert speculator._tree(same, RowTokens([], 0), 4) == ([4, 6, 5, 0], [-1, 0, 0, 1])
    short = _Req("c", [1, 2, 9, 1, 2], [])  # one continuation (9 1 2), then its last token repeated
    assert speculator._tree(short, RowTokens([], 0), 4) == ([9, 1, 2, 2], [-1, 0, 1, 2])
    fresh = _Req("d", [10, 11, 12], [])
    assert speculator._tree(fresh, RowTokens([], 0), 3) == ([12, 12, 12], [-1, 0, 1])
    # max_drafts counts the tree's nodes; a chain speculator on the same prompt sees one continuation's.
    req.kv_len = len(req.origin_input_ids) - 1
    assert speculator.max_drafts([req]) == 4


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_trees_give_the_plain_greedy_and_seeded_tokens(tiny_llama_dir, plain, overlap):
    seeded = [SamplingParams(max_new_tokens=n, temperature=0.7, top_p=0.9, seed=9 + n, ignore_eos=True)
              for n in BUDGETS]
    _, expected = run(tiny_llama_dir, False, overlap=overlap, params=seeded)
    engine_config = config(tiny_llama_dir, True, overlap=overlap)
    engine_config["speculative"].update(topk=2, num_tokens=4)
    engine = Engine(engine_config)
    assert engine.scheduler.worker.trees
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert summary(outputs) == summary(plain)
    steps = sum(o.spec_verify_steps for o in outputs)
    assert 0 < steps < sum(o.completion_tokens for o in outputs) - len(outputs), "drafts must be accepted"
    assert summary(engine.generate(input_ids=PROMPTS, sampling_params=seeded)) == summary(expected)
    assert_kv_accounted(engine)


def test_the_conformance_kit_passes_ngram_trees(tiny_llama_dir):
    from treadle.plugins.speculators.ngram import make_ngram_speculator
    from treadle.testing import check_speculator

    check_speculator(make_ngram_speculator, model_dir=tiny_llama_dir, overrides={"speculative": {"topk": 2}})
