"""fork(): branches continue from the same prefix, which the server computes once."""

from __future__ import annotations

from treadle.lang import assistant, function, gen, system, user

QUESTION = "Name one colour of the rainbow, in one word."


@function
def branches(s, n: int):
    s += system("Answer briefly.")
    s += user(QUESTION)
    forks = s.fork(n)
    forks += assistant(gen("colour", max_tokens=3))
    s.set_var("branches", forks)


def test_fork_branches_share_the_prefix_through_the_radix_cache(endpoint_backend):
    endpoint_backend.flush_cache()
    before = endpoint_backend.get_server_info()["cached_tokens_total"]

    state = branches.run(3, backend=endpoint_backend, temperature=0)

    forks = state["branches"]
    prefix_tokens = len(endpoint_backend.encode(state.text()))
    assert len(forks) == 3
    for fork in forks:
        assert fork.text().startswith(state.text())
        assert fork.get_meta_info("colour")["cached_tokens"] >= prefix_tokens - 1
    assert forks[0]["colour"] == forks[1]["colour"] == forks[2]["colour"]  # greedy
    after = endpoint_backend.get_server_info()["cached_tokens_total"]
    assert after - before >= 3 * (prefix_tokens - 1)
