"""select() picks the choice the model scores highest (mean token log-probability)."""

from __future__ import annotations

import pytest

from treadle.lang import assistant, function, select, system, user

CHOICES = ["London", "Paris", "the city of Berlin"]


@function
def pick_city(s):
    s += system("Answer briefly.")
    s += user("What is the capital of France?")
    s += assistant("The capital of France is " + select("city", CHOICES))


def _direct_scores(engine, prefix: str, choices: list[str]) -> list[float]:
    """Mean log-prob of each choice's tokens after ``prefix``, straight from Engine.generate."""
    tokenizer = engine.tokenizer
    prefix_ids = tokenizer.encode(prefix)
    sequences = [tokenizer.encode(prefix + choice) for choice in choices]
    outputs = engine.generate(input_ids=sequences, sampling_params={"max_new_tokens": 0},
                              return_logprob=True, logprob_start_len=0)
    scores = []
    for ids, out in zip(sequences, outputs):
        shared = next((i for i, (a, b) in enumerate(zip(prefix_ids, ids)) if a != b), len(prefix_ids))
        logprobs = out.input_token_logprobs[shared:]
        assert len(logprobs) == len(ids) - shared
        scores.append(sum(logprobs) / len(logprobs))
    return scores


def test_select_picks_the_choice_with_the_highest_log_probability(engine, engine_backend):
    state = pick_city.run(backend=engine_backend)

    prefix = state.text()[: state.text().rindex(state["city"])]
    with engine_backend._lock:
        expected = _direct_scores(engine, prefix, CHOICES)
    assert state["city"] == CHOICES[max(range(len(CHOICES)), key=expected.__getitem__)] == "Paris"
    assert state.get_meta_info("city")["normalized_logprobs"] == pytest.approx(expected, abs=1e-4)
    assert state.text().endswith("The capital of France is Paris<|im_end|>\n")
