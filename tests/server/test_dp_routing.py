"""The data-parallel controller's routing policies (server.dp_routing), without processes."""

from __future__ import annotations

import random

import pytest

from treadle.server.dp_routing import (
    OUTPUT_TOKENS_CAP,
    PREFIX_BLOCK_TOKENS,
    PREFIX_MAX_IMBALANCE_TOKENS,
    PrefixTracker,
    ReplicaRouter,
    block_keys,
    request_work,
)


def _route(router: ReplicaRouter, prompts: list[list[int]], max_new_tokens: int | None = None) -> list[int]:
    start = len(router.assigned) + sum(router.routed)
    return [router.choose(f"r{start + i}", ids, max_new_tokens) for i, ids in enumerate(prompts)]


def test_round_robin_takes_replicas_in_turn() -> None:
    router = ReplicaRouter("round_robin", 3)
    assert _route(router, [[1, 2, 3]] * 7) == [0, 1, 2, 0, 1, 2, 0]


def test_shortest_queue_counts_unfinished_requests() -> None:
    router = ReplicaRouter("shortest_queue", 2)
    assert [router.choose(f"q{i}", [1] * (1 + 500 * (i % 2))) for i in range(4)] == [0, 1, 0, 1]
    router.finished("q1")
    router.finished("q3")
    router.finished("unknown")
    assert router.loads == [2, 0] and router.replica_of("q0") == 0 and router.replica_of("q1") is None
    assert router.choose("q4", [1]) == 1  # the fewest requests, though not the least work


def test_least_work_counts_prompt_and_output_tokens_until_they_finish() -> None:
    router = ReplicaRouter("least_work", 2)
    assert router.choose("long", [1] * 600, 400) == 0
    assert [router.choose(f"s{i}", [1] * 50, 50) for i in range(3)] == [1, 1, 1]  # 300 tokens < 1,000
    assert router.work == [1000, 300] and router.loads == [1, 3]
    assert router.finished("long") == 0 and router.finished("long") is None
    assert router.work == [0, 300] and router.choose("next", [1] * 10, 10) == 0
    for rid in ("s0", "s1", "s2", "next"):
        router.finished(rid)
    assert router.work == [0, 0] and router.loads == [0, 0] and not router.assigned


def test_an_output_without_a_limit_counts_as_a_typical_one() -> None:
    assert request_work(100, None) == request_work(100, 10**6) == 100 + OUTPUT_TOKENS_CAP
    assert request_work(100, 7) == 107
    assert request_work(100, 7, cached_tokens=100) == 8  # the last prompt token is always computed


def _replica_work(policy: str, requests: list[tuple[int, int]], replicas: int = 4) -> list[int]:
    router = ReplicaRouter(policy, replicas)
    work = [0] * replicas
    rng = random.Random(1)
    for i, (prompt_len, output_len) in enumerate(requests):
        replica = router.choose(f"r{i}", [rng.randrange(50_000) for _ in range(prompt_len)], output_len)
        work[replica] += prompt_len + output_len
    return work


def test_least_work_evens_out_requests_of_unequal_sizes_that_equal_counts_do_not() -> None:
    # The `random` serving workload's lengths (16-600 in, 16-400 out), all routed before any finishes.
    rng = random.Random(0)
    requests = [(rng.randint(16, 600), rng.randint(16, 400)) for _ in range(400)]
    gap = {}
    for policy in ("round_robin", "shortest_queue", "least_work", "prefix_aware"):
        work = _replica_work(policy, requests)
        gap[policy] = max(work) / (sum(work) / len(work)) - 1
    assert gap["least_work"] < 0.005 and gap["prefix_aware"] == gap["least_work"]  # no shared prefix: least_work
    assert gap["round_robin"] == gap["shortest_queue"] > 0.02


def test_prefix_aware_sends_a_shared_prefix_where_it_went_before() -> None:
    router = ReplicaRouter("prefix_aware", 2)
    system = list(range(100, 100 + 3 * PREFIX_BLOCK_TOKENS))
    other = list(range(500, 500 + 3 * PREFIX_BLOCK_TOKENS))
    first = router.choose("a", system + [1, 2])
    assert router.choose("b", other + [3]) != first  # no match: the least work
    # Later requests with the same system prompt follow it, though that replica is busier.
    assert _route(router, [system + [i] for i in range(5)]) == [first] * 5
    # A prompt shorter than one block never matches: least work.
    assert router.choose("short", system[:PREFIX_BLOCK_TOKENS - 1]) != first


def test_prefix_aware_counts_the_matched_prefix_as_less_work() -> None:
    router = ReplicaRouter("prefix_aware", 2)
    system = list(range(20 * PREFIX_BLOCK_TOKENS))
    router.choose("a", system + [1], 10)
    assert router.choose("b", system + [2, 3], 10) == router.replica_of("a")
    assert router.assigned["a"].work == len(system) + 1 + 10
    assert router.assigned["b"].work == 2 + 10  # the prompt less the 20 cached blocks, plus the output


def test_prefix_aware_gives_up_a_match_on_a_much_busier_replica() -> None:
    router = ReplicaRouter("prefix_aware", 2)
    system = list(range(3 * PREFIX_BLOCK_TOKENS))
    replicas = _route(router, [system + [i] for i in range(60)], 400)
    assert set(replicas) == {0, 1}
    # The first replica took requests until it had more work than the margin plus the prefill its match saves.
    first, then = len(system) + 1 + 400, 1 + 400  # the first request's work, then each matched one's
    switched = replicas.index(1)
    assert first + (switched - 2) * then <= PREFIX_MAX_IMBALANCE_TOKENS + len(system) < first + (switched - 1) * then
    assert abs(router.work[0] - router.work[1]) <= PREFIX_MAX_IMBALANCE_TOKENS + len(system) + 401


def test_block_keys_chain_the_prefix() -> None:
    a = list(range(2 * PREFIX_BLOCK_TOKENS))
    b = list(range(1, PREFIX_BLOCK_TOKENS + 1)) + a[PREFIX_BLOCK_TOKENS:]
    assert len(block_keys(a)) == 2 and block_keys(a + [7]) == block_keys(a)
    assert block_keys(a)[1] != block_keys(b)[1]  # same second block, different first: different key
    tracker = PrefixTracker(capacity=2)
    tracker.add(a)
    assert tracker.matched_blocks(block_keys(a)) == 2
    tracker.add(b)  # evicts the oldest keys
    assert tracker.matched_blocks(block_keys(a)) == 0


def test_unknown_policy_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="round_robin, shortest_queue, least_work, prefix_aware"):
        ReplicaRouter("random", 2)
