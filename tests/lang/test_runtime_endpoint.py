"""The same program over HTTP (RuntimeEndpoint) and in-process (EngineBackend)."""

from __future__ import annotations

import pytest

from treadle.lang import RuntimeEndpointError, assistant, function, gen, select, system, user


@function
def interview(s, topic: str):
    s += system("You are a concise assistant.")
    s += user(f"Give me one fact about {topic}.")
    s += assistant(gen("fact", max_tokens=5))
    s += user("Is that true? Answer yes or no.")
    s += assistant(select("verdict", ["yes", "no"]))


def test_same_program_gives_the_same_greedy_output_on_both_backends(engine_backend, endpoint_backend):
    local = interview.run("the Moon", backend=engine_backend, temperature=0)
    remote = interview.run("the Moon", backend=endpoint_backend, temperature=0, stream=True)

    pieces = list(remote.text_iter("fact"))
    assert len(pieces) > 1  # streamed over SSE
    assert remote.text() == local.text()
    assert remote["fact"] == local["fact"] and remote["verdict"] == local["verdict"]
    assert remote.get_meta_info("verdict")["normalized_logprobs"] == pytest.approx(
        local.get_meta_info("verdict")["normalized_logprobs"], abs=1e-4
    )


def test_server_errors_name_the_bad_parameter(endpoint_backend):
    @function
    def bad(s):
        s += "Hello" + gen("x", max_tokens=2, temperature=-1.0)

    with pytest.raises(RuntimeEndpointError, match="temperature"):
        bad.run(backend=endpoint_backend)


@function
def birthday(s):
    s += user("When was Albert Einstein born, and describe him as JSON.")
    s += assistant("Born on " + gen("date", max_tokens=16, regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
                   + ". " + gen("person", max_tokens=48, json_schema={
                       "type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"}},
                       "required": ["name", "born"]}))


def test_constrained_gen_is_the_same_on_both_backends(engine_backend, endpoint_backend):
    import json
    import re

    local = birthday.run(backend=engine_backend, temperature=0)
    remote = birthday.run(backend=endpoint_backend, temperature=0, stream=True)
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", local["date"])
    assert set(json.loads(local["person"])) == {"name", "born"}
    assert remote["date"] == local["date"] and remote["person"] == local["person"]
    assert local.get_meta_info("person")["finish_reason"] == "stop"


def test_an_invalid_constraint_is_a_server_error_naming_it(endpoint_backend):
    @function
    def bad(s):
        s += "Hello" + gen("x", max_tokens=2, json_schema={"type": "no-such-type"})

    with pytest.raises(RuntimeEndpointError, match="json_schema"):
        bad.run(backend=endpoint_backend)
