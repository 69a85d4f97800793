"""Programs on the in-process Engine: multi-turn chat, run_batch ordering, streaming, constrained gen."""

from __future__ import annotations

import re

import pytest

from treadle.lang import assistant, function, gen, system, user


@function
def two_turns(s, first: str, second: str):
    s += system("You are a helpful assistant.")
    s += user(first)
    s += assistant(gen("first_answer", max_tokens=8))
    s += user(second)
    s += assistant(gen("second_answer", max_tokens=4))


def test_multi_turn_program_builds_the_chat_template_conversation(engine_backend):
    state = two_turns.run("What is the capital of France?", "And of Germany?", backend=engine_backend, temperature=0)

    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["first_answer"]
    assert "Paris" in state["first_answer"]
    # The prompt the model saw is exactly what the tokenizer's own chat template renders.
    assert state.text() == engine_backend.tokenizer.apply_chat_template(messages, tokenize=False)
    # The second turn re-reads the first from the radix cache instead of recomputing it.
    second = state.get_meta_info("second_answer")
    assert second["cached_tokens"] > 0
    assert second["prompt_tokens"] > state.get_meta_info("first_answer")["prompt_tokens"]


@function
def say_word(s, word: str, length: int):
    s += f"The word {word}, three times: " + gen("reply", max_tokens=length, ignore_eos=True)


def test_run_batch_returns_states_in_input_order(engine_backend):
    # Longer generations first, so threads finish out of order.
    batch = [{"word": w, "length": n} for w, n in [("apple", 6), ("river", 4), ("stone", 2), ("cloud", 1)]]
    states = say_word.run_batch(batch, backend=engine_backend, num_threads=4, temperature=0)

    assert [s.text().split(",")[0] for s in states] == [f"The word {b['word']}" for b in batch]
    assert [s.get_meta_info("reply")["completion_tokens"] for s in states] == [6, 4, 2, 1]
    # Threads sharing the Engine take turns: each result is what a lone run gives.
    alone = say_word.run(**batch[1], backend=engine_backend, temperature=0)
    assert states[1]["reply"] == alone["reply"]


def test_streaming_yields_the_text_while_the_program_runs(engine_backend):
    state = two_turns.run("Hi!", "How are you?", backend=engine_backend, temperature=0, stream=True)

    pieces = list(state.text_iter("first_answer"))
    assert len(pieces) > 1  # token by token, not one block at the end
    assert "".join(pieces) == state["first_answer"]
    assert "".join(state.text_iter()) == state.text()


@function
def capital(s):
    s += system("Answer briefly.")
    s += user("What is the capital of France?")
    s += assistant("The capital of France is" + gen("city", max_tokens=6, regex=r" [A-Z][a-z]+\."))


def test_gen_regex_constrains_decoding(engine_backend):
    state = capital.run(backend=engine_backend, temperature=0)

    assert re.fullmatch(r" [A-Z][a-z]+\.", state["city"])
    assert state["city"] == " Paris."
    assert state.get_meta_info("city")["finish_reason"] == "stop"
    assert state.text().endswith("The capital of France is Paris.<|im_end|>\n")


def test_with_role_blocks_write_the_same_text_as_role_calls(engine_backend):
    @function
    def as_calls(s):
        s += user("Hello")
        s += assistant("Hi there")

    @function
    def as_blocks(s):
        with s.user():
            s += "Hello"
        with s.assistant():
            s += "Hi" + " there"

    assert as_blocks.run(backend=engine_backend).text() == as_calls.run(backend=engine_backend).text()


def test_program_mistakes_are_reported_with_what_was_wrong(engine_backend):
    @function
    def nested(s):
        s += user("outer " + assistant("inner"))

    @function
    def empty(s):
        s += gen("x", max_tokens=1)

    @function
    def reads_unknown(s):
        s += "Hello"
        return s["missing"]

    with pytest.raises(ValueError, match="inside the open user block"):
        nested.run(backend=engine_backend)
    with pytest.raises(ValueError, match="needs some text before it"):
        empty.run(backend=engine_backend)
    with pytest.raises(KeyError, match="no variable 'missing'"):
        reads_unknown.run(backend=engine_backend)
    with pytest.raises(TypeError, match="missing a required argument"):
        say_word.run("apple", backend=engine_backend)
