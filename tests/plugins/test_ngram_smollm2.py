"""The embedded SmolLM2 with the ``ngram`` speculator on prompts that ask it to repeat or edit a given text: the
greedy output is the plain run's token for token, and each verify step keeps more than 1.5 tokens on average."""

from __future__ import annotations

from treadle import Engine, SamplingParams
from treadle.testing.engine import assert_kv_accounted
from treadle.testing.tokenizer import chat_prompt_ids

TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
        "All that glitters is not gold. Actions speak louder than words.")
ASKS = [f"Repeat this text exactly, word for word:\n\n{TEXT}",
        f"Rewrite this text with 'fox' replaced by 'cat', changing nothing else:\n\n{TEXT}"]
CONFIG = {"cache": {"max_total_tokens": 4096}, "plugins": ["treadle.plugins.speculators.ngram"]}


def test_ngram_on_copy_heavy_prompts_keeps_the_output_and_accepts_drafts(smollm2_dir):
    plain = Engine(CONFIG)
    prompts = [chat_prompt_ids(plain.tokenizer, ask) for ask in ASKS]
    params = SamplingParams(max_new_tokens=32, temperature=0)
    expected = plain.generate(input_ids=prompts, sampling_params=params)
    plain.shutdown()
    speculative = Engine({**CONFIG, "speculative": {"method": "ngram", "num_tokens": 4}})
    outputs = speculative.generate(input_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert outputs[0].text.startswith("The quick brown fox")
    for output in outputs:
        assert output.completion_tokens / output.spec_verify_steps > 1.5, (output.completion_tokens,
                                                                          output.spec_verify_steps)
    assert_kv_accounted(speculative)
    speculative.shutdown()
