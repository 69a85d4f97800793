"""The built-in schedule policies order a crafted waiting queue exactly as documented."""

from __future__ import annotations

import pytest

from treadle.core.memory.radix_cache import NoPrefixCache, RadixCache
from treadle.core.registry import build_registry
from treadle.core.request import Req, SamplingParams
from treadle.plugins.kv_allocators.token import TokenKVAllocator
from treadle.plugins.schedulers.policies import (
    DFSWeightPolicy,
    FCFSPolicy,
    LongestOutputFirstPolicy,
    LongestPrefixMatchPolicy,
    PriorityPolicy,
    RandomPolicy,
)

SYSTEM = list(range(100, 108))
CACHED = [SYSTEM + [1, 2, 3, 4], SYSTEM + [5, 6], list(range(200, 216))]

# rid: (prompt, output so far, max_new_tokens, priority); arrival = position in this table.
QUEUE = {
    "a0": ([9, 9, 9], [], 10, 0),
    "a1": (SYSTEM + [5, 6, 7], [], 40, 1),  # prefix 10 under SYSTEM
    "a2": (SYSTEM + [1, 2, 3, 4, 8], [], 10, 3),  # prefix 12 under SYSTEM
    "a3": (list(range(200, 211)) + [9], [], 80, 1),  # prefix 11, another subtree
    "a4": (SYSTEM + [1, 2, 3, 4], [7], 40, 0),  # prefix 12 (its output token counts)
    "a5": (SYSTEM + [9], [], 5, 3),  # prefix 8: ends at the shared SYSTEM node
    "a6": ([9, 8], [], 80, 0),
}


def make_queue() -> list[Req]:
    return [
        Req(
            rid=rid,
            origin_input_ids=list(prompt),
            sampling_params=SamplingParams(max_new_tokens=max_new, seed=0),
            priority=priority,
            output_ids=list(output),
            arrival=1000 + i,
        )
        for i, (rid, (prompt, output, max_new, priority)) in enumerate(QUEUE.items())
    ]


def radix_cache() -> RadixCache:
    allocator = TokenKVAllocator(128, 1)
    cache = RadixCache(allocator, 1)
    for tokens in CACHED:
        slots = allocator.alloc_extend([0], [len(tokens)], [-1])
        cache.insert(tokens, slots)
    return cache


def rids(policy, queue, cache) -> list[str]:
    return [req.rid for req in policy.order(queue, cache)]


def shuffled(queue: list[Req]) -> list[Req]:
    return [queue[i] for i in (3, 6, 0, 5, 2, 4, 1)]


def test_fcfs_orders_by_arrival_whatever_the_queue_order():
    assert rids(FCFSPolicy(0), shuffled(make_queue()), radix_cache()) == ["a0", "a1", "a2", "a3", "a4", "a5", "a6"]


def test_lpm_puts_the_longest_cached_prefix_first():
    order = rids(LongestPrefixMatchPolicy(0), shuffled(make_queue()), radix_cache())
    assert order == ["a2", "a4", "a3", "a1", "a5", "a0", "a6"]


def test_lpm_without_a_prefix_cache_is_fcfs():
    cache = NoPrefixCache(TokenKVAllocator(16, 1))
    assert rids(LongestPrefixMatchPolicy(0), shuffled(make_queue()), cache) == sorted(QUEUE)


def test_dfs_weight_admits_requests_sharing_a_prefix_together():
    # SYSTEM's subtree holds 4 waiting requests, so all of them go before a3 (prefix 11, alone in
    # its subtree) even though a1 and a5 match less; unmatched requests go last.
    order = rids(DFSWeightPolicy(0), shuffled(make_queue()), radix_cache())
    assert order == ["a2", "a4", "a1", "a5", "a3", "a0", "a6"]


def test_dfs_weight_visits_the_heavier_subtree_first():
    queue = make_queue()
    extra = Req(rid="a7", origin_input_ids=list(range(200, 216)), sampling_params=SamplingParams(seed=0),
                arrival=2000)
    extra2 = Req(rid="a8", origin_input_ids=list(range(200, 205)), sampling_params=SamplingParams(seed=0),
                 arrival=2001)
    keep = [r for r in queue if r.rid in ("a1", "a3", "a5")] + [extra, extra2]
    # 200.. subtree: a3, a7, a8 (weight 3) beats SYSTEM's a1, a5 (weight 2).
    assert rids(DFSWeightPolicy(0), keep, radix_cache()) == ["a7", "a3", "a8", "a1", "a5"]


def test_dfs_weight_without_a_prefix_cache_is_fcfs():
    cache = NoPrefixCache(TokenKVAllocator(16, 1))
    assert rids(DFSWeightPolicy(0), shuffled(make_queue()), cache) == sorted(QUEUE)


def test_lof_puts_the_longest_requested_output_first():
    order = rids(LongestOutputFirstPolicy(0), shuffled(make_queue()), radix_cache())
    assert order == ["a3", "a6", "a1", "a4", "a0", "a2", "a5"]


def test_priority_puts_larger_priority_first():
    order = rids(PriorityPolicy(0), shuffled(make_queue()), radix_cache())
    assert order == ["a2", "a5", "a1", "a3", "a0", "a4", "a6"]


def test_random_is_reproducible_for_a_seed():
    cache = radix_cache()
    # The same order in every process: a seeded run can be replayed.
    assert rids(RandomPolicy(0), make_queue(), cache) == ["a4", "a2", "a1", "a0", "a5", "a3", "a6"]
    assert rids(RandomPolicy(0), make_queue(), cache) == rids(RandomPolicy(0), shuffled(make_queue()), cache)
    orders = {tuple(rids(RandomPolicy(seed), make_queue(), cache)) for seed in range(5)}
    assert len(orders) > 1


def test_prefix_aware_policies_do_not_lock_or_insert():
    cache = radix_cache()
    free = cache.allocator.free_slots
    for policy in (LongestPrefixMatchPolicy(0), DFSWeightPolicy(0)):
        policy.order(make_queue(), cache)
    assert cache.protected_size() == 0 and cache.evictable_size() == sum(map(len, CACHED)) - len(SYSTEM)
    assert cache.allocator.free_slots == free


@pytest.mark.parametrize("name", ["fcfs", "lpm", "random", "dfs-weight", "lof", "priority"])
def test_every_policy_is_registered_and_takes_a_seed(name):
    policy = build_registry().get("schedule_policies", name)(3)
    assert sorted(rids(policy, make_queue(), radix_cache())) == sorted(QUEUE)


@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
def test_prefix_policies_fall_back_to_arrival_order_on_long_queues(name):
    from treadle.plugins.schedulers.policies import MAX_PREFIX_MATCHED_QUEUE

    registry = build_registry()
    allocator = registry.get("kv_allocators", "token")(64, 1, "cpu")
    cache = RadixCache(allocator, 1)
    slots = allocator.alloc_extend([0], [4], [-1])
    cache.insert([9, 9, 9, 9], slots)
    reqs = [Req(rid=str(i), origin_input_ids=[1, 2], sampling_params=SamplingParams())
            for i in range(MAX_PREFIX_MATCHED_QUEUE)]
    reqs.append(Req(rid="hit", origin_input_ids=[9, 9, 9, 9, 1], sampling_params=SamplingParams()))
    policy = registry.get("schedule_policies", name)(0)
    assert policy.order(reqs, cache)[-1].rid == "hit"  # too many to match: arrival order
    assert policy.order(reqs[-5:], cache)[0].rid == "hit"  # few enough: the cached prefix goes first
