"""Constrained decoding on the GPU: the pinned host mask reaches the device, overlap and CUDA graphs on."""

from __future__ import annotations

import json
import re

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.core.grammar import apply_vocab_mask, bitmask_width

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                          "tag": {"enum": ["a", "b"]}}, "required": ["n", "tag"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from treadle.testing.models import make_tiny_llama
    from treadle.testing.tokenizer import make_tiny_tokenizer

    path = make_tiny_llama(tmp_path_factory.mktemp("grammar-gpu"))
    return make_tiny_tokenizer(path)


def test_the_device_mask_equals_the_cpu_mask():
    vocab = 128256
    bitmask = torch.randint(-2**31, 2**31 - 1, (8, bitmask_width(vocab)), dtype=torch.int32)
    logits = torch.randn(8, vocab)
    on_cpu = apply_vocab_mask(logits, bitmask)
    on_gpu = apply_vocab_mask(logits.cuda(), bitmask.cuda()).cpu()
    assert torch.equal(on_cpu.isinf(), on_gpu.isinf()) and torch.equal(on_cpu, on_gpu)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_constrained_batch_on_cuda_matches_overlap_off(model_dir, backend):
    pytest.importorskip(backend)  # the GPU machine's wheels (../shared/device/wheels.sh) have no llguidance
    prompts = [[5, 17, 42, 8, 99], [300, 301, 9], [7, 7, 7, 120, 121, 122], [44, 45]] * 4
    params = [SamplingParams(max_new_tokens=48, temperature=0, json_schema=json.dumps(SCHEMA)),
              SamplingParams(max_new_tokens=32, temperature=0, regex=r"[a-z]{3}-[0-9]{2,4}"),
              SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=48, temperature=0.7, seed=5, regex=r"(yes|no)( [a-z]+){2}")] * 4
    outputs = {}
    for overlap in (True, False):
        engine = Engine({"model": {"path": model_dir, "device": "cuda"}, "grammar": {"backend": backend},
                         "scheduler": {"disable_overlap": not overlap}})
        outputs[overlap] = engine.generate(input_ids=prompts, sampling_params=params)
        engine.shutdown()
    assert [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]
    for i, out in enumerate(outputs[True]):
        if i % 4 == 0:
            assert set(json.loads(out.text)) == {"n", "tag"}
        elif i % 4 == 1:
            assert re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", out.text)
        elif i % 4 == 3:
            assert re.fullmatch(r"(yes|no)( [a-z]+){2}", out.text)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_verify_steps_mask_every_position_on_cuda(model_dir, method):
    """Constrained requests under speculation on CUDA (verify graphs, overlap on, drafts copied home before the
    target's forward): the outputs keep their constraints, they were verified (not decoded one token a step), and
    greedy tokens are the plain run's but where a numerically different verify step flips a near-tie."""
    from treadle.testing.engine import assert_kv_accounted

    prompts = [[5, 17, 42, 8, 99, 5, 17, 42, 8, 99], [300, 301, 9, 300, 301, 9], [7, 7, 7, 120, 121, 122], [44, 45]] * 2
    params = [SamplingParams(max_new_tokens=48, temperature=0, json_schema=json.dumps(SCHEMA)),
              SamplingParams(max_new_tokens=32, temperature=0, regex=r"[a-z]{3}-[0-9]{2,4}"),
              SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=48, temperature=0.7, seed=5, regex=r"(yes|no)( [a-z]+){2}")] * 2
    config = {"model": {"path": model_dir, "device": "cuda"}, "plugins": [f"treadle.plugins.speculators.{method}"]}
    with Engine(config) as plain_engine:
        plain = plain_engine.generate(input_ids=prompts, sampling_params=params)
    spec = {"method": method, "num_tokens": 3, **({"draft_model_path": model_dir} if method == "draft" else {})}
    with Engine({**config, "speculative": spec}) as engine:
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        assert_kv_accounted(engine)
    for i, out in enumerate(outputs):
        if i % 4 == 0:
            assert set(json.loads(out.text)) == {"n", "tag"}, out.text
        elif i % 4 == 1:
            assert re.fullmatch(r"[a-z]{3}-[0-9]{2,4}", out.text), out.text
        elif i % 4 == 3:
            assert re.fullmatch(r"(yes|no)( [a-z]+){2}", out.text), out.text
    assert sum(o.spec_verify_steps for i, o in enumerate(outputs) if i % 4 in (0, 1)) > 0
    greedy = [i for i in range(len(prompts)) if i % 4 != 3]
    assert sum(outputs[i].token_ids == plain[i].token_ids for i in greedy) >= len(greedy) - 2
