"""The embedded default model through the whole engine: token-identical to HF transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.testing.engine import assert_kv_accounted
from treadle.testing.tokenizer import chat_prompt_ids

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    engine = Engine({"cache": {"kv_allocator": "paged", "page_size": 4, "max_total_tokens": 4096}})
    yield engine
    engine.shutdown()


def test_default_model_answers_like_hf(engine, smollm2_dir):
    from transformers import AutoModelForCausalLM

    prompts = [chat_prompt_ids(engine.tokenizer, q) for q in
               (QUESTION, "Name three colors.", "Write a haiku about the sea.")]
    outputs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=24, temperature=0))
    assert outputs[0].text == "The capital of France is Paris."
    assert outputs[0].finish_reason == "stop"

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        for ids, output in zip(prompts, outputs):
            expected = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24)[0, len(ids):].tolist()
            # HF keeps the EOS token in its output; treadle reports it as the matched stop.
            if output.finish_reason == "stop":
                assert expected[: len(output.token_ids)] == output.token_ids
                assert expected[len(output.token_ids) - 1] == output.matched_stop
            else:
                assert expected == output.token_ids
    assert_kv_accounted(engine)


def test_stop_strings_are_trimmed_from_text(engine):
    out = engine.generate(input_ids=chat_prompt_ids(engine.tokenizer, QUESTION),
                          sampling_params=SamplingParams(max_new_tokens=24, temperature=0, stop=["France"]))
    assert out.text == "The capital of "
    assert out.finish_reason == "stop" and out.matched_stop == "France"
    assert_kv_accounted(engine)


def test_text_prompts_and_batches_keep_order(engine):
    outs = engine.generate(["The capital of France is", "One, two, three,"],
                           SamplingParams(max_new_tokens=4, temperature=0))
    assert len(outs) == 2 and all(o.completion_tokens == 4 for o in outs)
    single = engine.generate("One, two, three,", SamplingParams(max_new_tokens=4, temperature=0))
    assert single.text == outs[1].text
    assert_kv_accounted(engine)


def test_generate_cli_prints_the_answer(smollm2_dir):
    result = subprocess.run(
        [sys.executable, "-m", "treadle", "generate", "--chat", "--prompt", QUESTION, "--max-new-tokens", "16"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "The capital of France is Paris."
