"""RadixCache / NoPrefixCache: prefix sharing with exact KV slot accounting."""

from __future__ import annotations

import pytest
import torch

from treadle.core.memory.radix_cache import NoPrefixCache, RadixCache
from treadle.core.request import Req, SamplingParams
from treadle.plugins.kv_allocators.paged import PagedKVAllocator
from treadle.plugins.kv_allocators.token import TokenKVAllocator


def make_cache(page_size: int = 1, size: int = 128) -> tuple[RadixCache, TokenKVAllocator | PagedKVAllocator]:
    allocator = TokenKVAllocator(size, 1) if page_size == 1 else PagedKVAllocator(size, page_size)
    return RadixCache(allocator, page_size), allocator


def admit(cache, allocator, prompt: list[int], output: tuple[int, ...] = (), computed: int | None = None) -> Req:
    """What the scheduler does at admission: match, lock, allocate the rest of the computed tokens."""
    req = Req(rid=f"r{len(prompt)}", origin_input_ids=list(prompt), sampling_params=SamplingParams(seed=0))
    req.output_ids = list(output)
    prefix_slots, node = cache.match_prefix(req.all_ids)
    cache.inc_lock_ref(node)
    computed = req.seq_len if computed is None else max(computed, prefix_slots.numel())
    last = int(prefix_slots[-1]) if prefix_slots.numel() else -1
    new = allocator.alloc_extend([prefix_slots.numel()], [computed - prefix_slots.numel()], [last])
    assert new is not None
    req.kv_slots = torch.cat([prefix_slots, new])
    req.prefix_len = prefix_slots.numel()
    req.last_node = node
    return req


def cached(cache: RadixCache) -> int:
    return cache.evictable_size() + cache.protected_size()


def test_match_returns_the_slots_of_the_longest_cached_prefix():
    cache, allocator = make_cache()
    slots = allocator.alloc_extend([0], [5], [-1])
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    matched, node = cache.match_prefix([1, 2, 3, 9, 9])
    assert matched.tolist() == slots[:3].tolist()
    assert node.key == [1, 2, 3] and node.parent is cache.root
    assert cache.match_prefix([9])[0].numel() == 0
    assert cache.evictable_size() == 5  # the split at 3 changes nothing cached


def test_insert_reports_the_length_already_cached():
    cache, allocator = make_cache()
    first = allocator.alloc_extend([0], [4], [-1])
    assert cache.insert([1, 2, 3, 4], first) == 0
    second = allocator.alloc_extend([0], [6], [-1])
    assert cache.insert([1, 2, 3, 4, 5, 6], second) == 4
    # The tree keeps its own copy of the shared part and takes the new tail.
    assert cache.match_prefix([1, 2, 3, 4, 5, 6])[0].tolist() == first.tolist() + second[4:].tolist()


def test_finished_requests_keep_free_plus_cached_equal_to_total():
    cache, allocator = make_cache()
    a = admit(cache, allocator, list(range(10)), output=[50, 51, 52], computed=12)
    cache.cache_finished_req(a)
    assert cached(cache) == 12 and cache.protected_size() == 0
    assert allocator.free_slots + cached(cache) == allocator.total_slots

    b = admit(cache, allocator, list(range(8)) + [70, 71, 72])
    assert b.prefix_len == 8 and b.kv_slots[:8].tolist() == a.kv_slots[:8].tolist()
    assert cache.protected_size() == 8
    cache.cache_finished_req(b)
    assert cache.protected_size() == 0 and cached(cache) == 12 + 3
    assert allocator.free_slots + cached(cache) == allocator.total_slots


def test_finishing_a_duplicate_frees_the_copies():
    cache, allocator = make_cache()
    # Both computed the same prompt before either was cached.
    first = admit(cache, allocator, [5, 6, 7, 8])
    second = admit(cache, allocator, [5, 6, 7, 8, 9])
    assert second.prefix_len == 0
    cache.cache_finished_req(first)
    cache.cache_finished_req(second)
    assert cached(cache) == 5
    assert allocator.free_slots == allocator.total_slots - 5


def test_evict_frees_exactly_the_least_recently_used_leaves():
    cache, allocator = make_cache()
    for prompt in ([1, 2, 3], [4, 5, 6, 7], [8, 9]):
        cache.cache_finished_req(admit(cache, allocator, prompt))
    cache.match_prefix([1, 2, 3])  # now [4, 5, 6, 7] is the least recently used
    free_before = allocator.free_slots
    assert cache.evict(2) == 4
    assert allocator.free_slots == free_before + 4
    assert cache.match_prefix([4, 5, 6, 7])[0].numel() == 0
    assert cache.match_prefix([1, 2, 3])[0].numel() == 3
    assert cache.evictable_size() == 5


def test_eviction_follows_use_order_through_touches_unlocks_and_emptied_parents():
    """The candidates heap is kept lazily (a touched leaf goes back in at its new age, a parent whose last
    child went becomes a candidate); the order must be what a full scan of the tree would give. (Matching
    touches nodes, so what is left is checked only at the end.)"""
    cache, allocator = make_cache(size=256)
    for prompt in ([1, 2, 3, 4], [1, 2, 3, 5], [6, 7], [8, 9, 10], [11]):
        cache.cache_finished_req(admit(cache, allocator, prompt))
    cache.match_prefix([6, 7])  # [6, 7] is newest; oldest: leaf [4], leaf [5] (with [1, 2, 3]), [8, 9, 10], [11]
    held = admit(cache, allocator, [8, 9, 10, 12])  # uses and locks [8, 9, 10] while it runs
    assert cache.evict(1) == 1  # leaf [4]
    assert cache.evict(2) == 1 + 3  # leaf [5], then its emptied parent [1, 2, 3], older than the rest
    assert cache.evict(1) == 1  # [8, 9, 10] is locked: [11]
    assert cache.evictable_size() == 2  # [6, 7]
    cache.cache_finished_req(held)  # unlocked, with a new leaf [12]: candidates again
    assert cache.evict(3) == 2 + 1  # [6, 7] was used before [8, 9, 10, 12] was admitted; then leaf [12]
    assert cache.match_prefix([6, 7])[0].numel() == 0 and cache.match_prefix([8, 9, 10, 12])[0].numel() == 3
    assert cache.evict(100) == 3 and cached(cache) == 0
    assert allocator.free_slots == allocator.total_slots


def test_the_candidates_heap_stays_proportional_to_the_tree_without_evictions():
    cache, allocator = make_cache(size=64)
    for _ in range(3000):  # the same prompt finishing again and again: one push per unlock, no eviction
        cache.cache_finished_req(admit(cache, allocator, [1, 2, 3]))
    assert len(cache._heap) <= 2 * cache._num_nodes + 1025
    assert cache.evict(100) == 3 and allocator.free_slots == allocator.total_slots


def test_locked_prefixes_are_not_evicted():
    cache, allocator = make_cache()
    cache.cache_finished_req(admit(cache, allocator, list(range(6))))
    running = admit(cache, allocator, list(range(4)) + [40, 41])
    assert cache.protected_size() == 4 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix(list(range(6)))[0].numel() == 4
    assert cached(cache) == 4 and allocator.free_slots == allocator.total_slots - 4 - 2
    cache.cache_finished_req(running)
    assert cache.protected_size() == 0 and cache.evictable_size() == 6
    assert cache.evict(100) == 6
    assert allocator.free_slots == allocator.total_slots


def test_unbalanced_unlock_is_an_error():
    cache, allocator = make_cache()
    cache.cache_finished_req(admit(cache, allocator, [1, 2]))
    node = cache.match_prefix([1, 2])[1]
    with pytest.raises(RuntimeError, match="unbalanced"):
        cache.dec_lock_ref(node)


def test_page_size_4_matches_and_caches_whole_pages_only():
    cache, allocator = make_cache(page_size=4, size=64)
    req = admit(cache, allocator, list(range(10)))
    cache.cache_finished_req(req)
    assert cached(cache) == 8  # the unaligned tail of 2 was freed with its page
    assert allocator.free_slots == 64 - 8
    assert cache.match_prefix(list(range(7)))[0].tolist() == req.kv_slots[:4].tolist()
    # A difference inside the second page drops that whole page from the match.
    assert cache.match_prefix(list(range(6)) + [99, 99, 99])[0].numel() == 4

    other = admit(cache, allocator, list(range(5)) + [90, 91, 92, 93, 94, 95])
    assert other.prefix_len == 4
    assert (other.kv_slots % 4 == torch.arange(11) % 4).all()  # its own pages, position-aligned
    cache.cache_finished_req(other)
    assert cached(cache) == 8 + 4
    assert allocator.free_slots + cached(cache) == allocator.total_slots
    assert cache.evict(100) == 12 and allocator.free_slots == allocator.total_slots


@pytest.mark.parametrize("page_size", [1, 4])
def test_unfinished_request_moves_its_prefix_into_the_tree(page_size):
    cache, allocator = make_cache(page_size=page_size, size=64)
    prompt = list(range(20))
    req = admit(cache, allocator, prompt, computed=10)  # first prefill chunk
    own_slots = req.kv_slots.clone()
    cache.cache_unfinished_req(req)
    aligned = 10 - 10 % page_size
    assert req.prefix_len == aligned and req.kv_len == 10
    assert req.kv_slots.tolist() == own_slots.tolist()
    assert cache.protected_size() == aligned and cache.evictable_size() == 0
    # Second chunk continues where the first stopped.
    more = allocator.alloc_extend([10], [10], [int(req.kv_slots[-1])])
    req.kv_slots = torch.cat([req.kv_slots, more])
    cache.cache_finished_req(req)
    assert cache.protected_size() == 0 and cached(cache) == 20
    assert allocator.free_slots + cached(cache) == allocator.total_slots


def test_unfinished_request_switches_to_the_trees_copy_of_duplicates():
    cache, allocator = make_cache()
    req = admit(cache, allocator, list(range(8)), computed=6)
    cache.cache_finished_req(admit(cache, allocator, list(range(8))))  # another request cached it meanwhile
    tree_slots = cache.match_prefix(list(range(6)))[0]
    cache.cache_unfinished_req(req)
    assert req.kv_slots.tolist() == tree_slots.tolist()
    assert req.prefix_len == 6 and cache.protected_size() == 6
    assert allocator.free_slots + cached(cache) == allocator.total_slots
    cache.dec_lock_ref(req.last_node)
    assert cache.protected_size() == 0


def test_reset_frees_everything_and_refuses_while_locked():
    cache, allocator = make_cache()
    cache.cache_finished_req(admit(cache, allocator, [1, 2, 3]))
    running = admit(cache, allocator, [1, 2, 4])
    with pytest.raises(RuntimeError, match="lock"):
        cache.reset()
    cache.cache_finished_req(running)
    cache.reset()
    assert allocator.free_slots == allocator.total_slots
    assert cached(cache) == 0 and cache.match_prefix([1, 2, 3])[0].numel() == 0


def test_page_size_must_match_the_allocator():
    with pytest.raises(ValueError, match="page size"):
        RadixCache(TokenKVAllocator(16, 1), page_size=4)


def test_no_prefix_cache_caches_nothing_and_frees_everything():
    allocator = TokenKVAllocator(32, 1)
    cache = NoPrefixCache(allocator)
    req = admit(cache, allocator, [1, 2, 3, 4])
    assert req.prefix_len == 0 and cache.match_prefix([1, 2, 3, 4])[0].numel() == 0
    cache.cache_unfinished_req(req)
    assert req.kv_len == 4 and allocator.free_slots == 28
    cache.cache_finished_req(req)
    assert allocator.free_slots == 32
    assert cache.evictable_size() == cache.protected_size() == cache.evict(10) == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_random_workload_never_loses_or_double_frees_a_slot(page_size):
    import random

    rng = random.Random(page_size)
    cache, allocator = make_cache(page_size=page_size, size=128)
    prefixes = [[rng.randint(0, 4) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    running: list[Req] = []

    def own_slots(req: Req) -> int:
        return -(-(req.kv_len - req.prefix_len) // page_size) * page_size

    for _ in range(150):
        if not running or rng.random() < 0.35:
            prompt = rng.choice(prefixes) + [rng.randint(0, 4) for _ in range(rng.randint(1, 16))]
            cache.evict(allocator.slots_needed(0, len(prompt)))
            running.append(admit(cache, allocator, prompt, computed=rng.randint(1, len(prompt))))
        elif rng.random() < 0.5:
            req = rng.choice(running)
            req.output_ids.append(rng.randint(0, 4))
            cache.evict(allocator.slots_needed(req.kv_len, req.seq_len - req.kv_len))
            more = allocator.alloc_extend([req.kv_len], [req.seq_len - req.kv_len], [int(req.kv_slots[-1])])
            req.kv_slots = torch.cat([req.kv_slots, more])
            cache.cache_unfinished_req(req)
        else:
            cache.cache_finished_req(running.pop(rng.randrange(len(running))))
        owned = sum(own_slots(req) for req in running)
        assert allocator.free_slots + cached(cache) + owned == allocator.total_slots
    for req in running:
        cache.cache_finished_req(req)
    assert cache.protected_size() == 0
    cache.reset()
    assert allocator.free_slots == allocator.total_slots


def test_namespaces_keep_prefixes_apart_and_evict_like_the_base():
    """A LoRA adapter's prefixes (a namespace) are matched only under it; locks stop at its root; its leaves are
    evicted with the base's, least recently used first, and a reset frees them too."""
    cache, allocator = make_cache()
    tokens = [1, 2, 3, 4, 5, 6]
    base_slots, adapter_slots = (allocator.alloc_extend([0], [6], [-1]) for _ in range(2))
    free = allocator.free_slots
    assert cache.insert(tokens, base_slots) == 0
    assert cache.insert(tokens, adapter_slots, namespace=7) == 0  # the base's copy is not the adapter's
    assert torch.equal(cache.match_prefix(tokens)[0], base_slots)
    assert torch.equal(cache.match_prefix(tokens, 7)[0], adapter_slots)
    assert cache.match_prefix(tokens, 8)[0].numel() == 0
    _, node = cache.match_prefix(tokens[:3], 7)
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 9
    assert cache.evict(100) == 9  # everything unlocked: the base's six and the adapter's last three
    assert torch.equal(cache.match_prefix(tokens, 7)[0], adapter_slots[:3])
    cache.dec_lock_ref(node)
    cache.reset()
    assert allocator.free_slots == free + 12 and cache.match_prefix(tokens, 7)[0].numel() == 0
