"""Structured output under speculative decoding: each verified position is masked with the constraint's state after
the drafts before it (the matcher walked through them, then rolled back), so greedy output equals the plain run's
token for token (JSON schema and regex; ``ngram`` and ``draft``; xgrammar and llguidance), sampled output still
matches, and a draft the constraint forbids is never kept."""

from __future__ import annotations

import json
import re

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.core.grammar import Constraint, GrammarManager, bitmask_width
from treadle.core.request import Req
from treadle.core.registry import build_registry
from treadle.testing.engine import assert_kv_accounted

PLUGINS = ["treadle.plugins.speculators.ngram", "treadle.plugins.speculators.draft"]
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"},
                                                      "tags": {"type": "array", "items": {"enum": ["ab", "cd"]},
                                                               "maxItems": 4}},
                     "required": ["name", "tags"]})
REGEX = r"(ab|ba)+ x[0-9]{2,6}"
CONSTRAINED = [SamplingParams(max_new_tokens=40, temperature=0.0, json_schema=SCHEMA),
               SamplingParams(max_new_tokens=30, temperature=0.0, regex=REGEX),
               SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)]  # an unconstrained neighbour


def engine_config(model_dir: str, backend: str, method: str | None = None, topk: int = 1) -> dict:
    config = {"model": {"path": model_dir}, "cache": {"max_total_tokens": 2048}, "plugins": PLUGINS,
              "grammar": {"backend": backend}}
    if method is not None:
        config["speculative"] = {"method": method, "num_tokens": 3, "topk": topk,
                                 **({"draft_model_path": model_dir} if method == "draft" else {})}
    return config


def prompts(engine: Engine) -> list[list[int]]:
    # Repeated text, so that ngram finds something to propose.
    return [engine.tokenizer.encode(text) for text in ('{"name": "ab", "tags": ["ab", "cd"]} {"name": "ab", ',
                                                       "ab ab ab x12 ba ab x12 ab", "The capital of France")]


@pytest.fixture(scope="module")
def plain_tokens(tiny_llama_text_dir):
    """``plain_tokens(backend)``: the constrained prompts' tokens without speculation (each backend run once)."""
    runs: dict[str, list[list[int]]] = {}

    def tokens(backend: str) -> list[list[int]]:
        if backend not in runs:
            with Engine(engine_config(tiny_llama_text_dir, backend)) as plain:
                runs[backend] = [o.token_ids for o in plain.generate(input_ids=prompts(plain),
                                                                      sampling_params=CONSTRAINED)]
        return runs[backend]

    return tokens


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_greedy_constrained_output_is_the_plain_runs(tiny_llama_text_dir, plain_tokens, backend):
    expected = plain_tokens(backend)
    for method in ("ngram", "draft"):
        with Engine(engine_config(tiny_llama_text_dir, backend, method)) as engine:
            outputs = engine.generate(input_ids=prompts(engine), sampling_params=CONSTRAINED)
            assert [o.token_ids for o in outputs] == expected, method
            constrained = outputs[:2]
            assert all(o.spec_verify_steps > 0 for o in constrained), method  # verified, not decoded one by one
            # The draft model is the target: whatever its unmasked argmax has that the constraint allows is kept.
            assert sum(o.completion_tokens for o in constrained) > sum(o.spec_verify_steps for o in constrained)
            assert_kv_accounted(engine)


def test_with_draft_trees_a_constrained_request_decodes_plainly(tiny_llama_text_dir, plain_tokens):
    """A tree's nodes would each need their own path's mask: a batch holding a constrained request takes one token
    a step, with the plain run's tokens."""
    with Engine(engine_config(tiny_llama_text_dir, "xgrammar", "draft", topk=2)) as engine:
        outputs = engine.generate(input_ids=prompts(engine), sampling_params=CONSTRAINED)
        assert [o.token_ids for o in outputs] == plain_tokens("xgrammar")
        assert_kv_accounted(engine)


def test_sampled_constrained_output_still_matches(tiny_llama_text_dir):
    params = [SamplingParams(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=seed, regex=REGEX)
              for seed in range(4)]
    with Engine(engine_config(tiny_llama_text_dir, "xgrammar", "draft")) as engine:
        outputs = engine.generate(input_ids=[prompts(engine)[1]] * len(params), sampling_params=params)
        for output in outputs:
            assert output.finish_reason == "stop" and re.fullmatch(REGEX, output.text), output.text
        assert_kv_accounted(engine)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_verify_mask_rows_follow_the_drafts_and_leave_the_matcher_where_it_was(tiny_llama_text_dir, backend):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_text_dir)
    registry = build_registry([])
    manager = GrammarManager(registry.get("grammar_backends", backend), backend, tokenizer, 512, [2],
                             torch.device("cpu"))
    compiled = manager.compile(Constraint("regex", "ab[0-9]+"))
    a, b, one, two = (tokenizer.convert_tokens_to_ids(t) for t in "ab12")
    constrained = Req(rid="c", origin_input_ids=[1], sampling_params=SamplingParams())
    constrained.grammar = manager.backend.new_matcher(compiled)
    free = Req(rid="f", origin_input_ids=[1], sampling_params=SamplingParams())
    drafts = [[a, b, one, a], [a, a, a, a]]  # the second "a" after "ab1" is off the grammar: the walk ends there
    mask = manager.verify_mask([constrained, free], lambda: drafts)
    assert mask.shape == (10, bitmask_width(512))

    def allowed(row: torch.Tensor) -> set[int]:
        return {t for t in range(512) if (int(row[t >> 5]) >> (t & 31)) & 1}

    fresh = manager.backend.new_matcher(compiled)
    expected = []
    for token in drafts[0][:3]:
        row = torch.zeros(1, bitmask_width(512), dtype=torch.int32)
        fresh.fill_bitmask(row, 0)
        expected.append(allowed(row[0]))
        assert fresh.accept_token(token)
    row = torch.zeros(1, bitmask_width(512), dtype=torch.int32)
    fresh.fill_bitmask(row, 0)
    expected.append(allowed(row[0]))
    assert [allowed(mask[j]) for j in range(4)] == expected
    assert expected[0] == {a} and one in expected[3] and a not in expected[3]  # the draft at row 3 is rejected
    assert all(len(allowed(mask[j])) == 512 for j in range(4, 10))  # after the cut, and the free request
    again = manager.verify_mask([constrained], lambda: [[b, b, b, b]])  # rolled back: still at the start
    assert allowed(again[0]) == {a} and len(allowed(again[1])) == 512
