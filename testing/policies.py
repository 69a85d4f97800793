"""``check_schedule_policy``: does a SchedulePolicy plugin order the waiting queue the way treadle relies on?"""

from __future__ import annotations

from typing import Any, Callable

from treadle.core.memory.allocator import KVAllocator
from treadle.core.memory.radix_cache import NoPrefixCache, PrefixCache, RadixCache
from treadle.core.request import Req, SamplingParams
from treadle.core.scheduling.policy import SchedulePolicy

PolicyFactory = Callable[[int], SchedulePolicy]


def check_schedule_policy(factory: PolicyFactory, *, seeds: tuple[int, ...] = (0, 1, 7)) -> None:
    """Assert that ``factory(seed)`` builds a conforming :class:`SchedulePolicy`.

    Checked, with an empty queue, a single request and a queue of requests
    that share prefixes (some with output tokens, priorities and lengths that
    differ), against both a :class:`NoPrefixCache` and a populated
    :class:`RadixCache` that a running request holds a lock in:

    - ``order`` returns a list that is a permutation of the queue (same
      request objects, none dropped or added);
    - two policies built with the same seed give the same orders, call after call;
    - the requests and the prefix cache's contents, slots, locks and sizes are
      unchanged (``match_prefix`` may refresh ``last_access`` or split a node).

    Raises AssertionError naming the broken rule.
    """
    name = getattr(factory, "__name__", repr(factory))
    policy = factory(seeds[0])
    _expect(isinstance(policy, SchedulePolicy), f"{name}(seed) built a {type(policy).__name__}, not a SchedulePolicy")
    for cache_kind in ("none", "radix"):
        for seed in seeds:
            _check_with_cache(factory, name, seed, cache_kind)


def _check_with_cache(factory: PolicyFactory, name: str, seed: int, cache_kind: str) -> None:
    cache, allocator = _build_cache(cache_kind)
    queue = _crafted_queue()
    first, second = factory(seed), factory(seed)
    where = f"{name}(seed={seed}) with {type(cache).__name__}"

    for waiting in ([], queue[:1]):
        ordered = first.order(list(waiting), cache)
        second.order(list(waiting), cache)
        _expect_permutation(ordered, waiting, where)

    cache_before = _cache_state(cache, allocator)
    reqs_before = [_req_state(req) for req in queue]
    for call in range(3):
        ordered = first.order(list(queue), cache)
        again = second.order(list(queue), cache)
        _expect_permutation(ordered, queue, where)
        _expect(
            [r.rid for r in ordered] == [r.rid for r in again],
            f"{where}: two policies built with the same seed ordered the same queue differently on call "
            f"{call + 1}: {[r.rid for r in ordered]} vs {[r.rid for r in again]}",
        )
    _expect(_cache_state(cache, allocator) == cache_before, f"{where}: order() changed the prefix cache's contents or locks")
    _expect(
        [_req_state(req) for req in queue] == reqs_before,
        f"{where}: order() changed the requests' fields (it must only reorder them)",
    )


def _expect_permutation(ordered: Any, waiting: list[Req], where: str) -> None:
    _expect(isinstance(ordered, list), f"{where}: order() returned {type(ordered).__name__}, not a list")
    _expect(
        len(ordered) == len(waiting) and {id(r) for r in ordered} == {id(r) for r in waiting},
        f"{where}: order() must return a permutation of the {len(waiting)} waiting requests, got "
        f"{len(ordered)} ({[getattr(r, 'rid', r) for r in ordered]})",
    )


# A shared system prompt, two conversations under it, and unrelated prompts.
_SYSTEM = list(range(100, 116))
_PROMPTS: list[tuple[str, list[int], list[int], int, int]] = [
    # rid, prompt, output so far, max_new_tokens, priority
    ("q0", [7, 8, 9], [], 16, 0),
    ("q1", _SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8], [], 64, 1),
    ("q2", _SYSTEM + [1, 2, 3, 4, 9, 9], [50, 51], 8, 0),
    ("q3", list(range(200, 230)), [], 128, 2),
    ("q4", _SYSTEM + [20, 21], [], 32, 0),
    ("q5", _SYSTEM[:8], [], 16, 5),
    ("q6", [7, 8, 9, 10, 11], [60], 4, 1),
    ("q7", _SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8], [], 64, 1),
]
_CACHED = [_SYSTEM + [1, 2, 3, 4, 5, 6, 7, 8], _SYSTEM + [20, 21, 22, 23], list(range(200, 212))]


def _crafted_queue() -> list[Req]:
    return [
        Req(
            rid=rid,
            origin_input_ids=list(prompt),
            sampling_params=SamplingParams(max_new_tokens=max_new, seed=0),
            priority=priority,
            output_ids=list(output),
            arrival=i,
        )
        for i, (rid, prompt, output, max_new, priority) in enumerate(_PROMPTS)
    ]


def _build_cache(kind: str) -> tuple[PrefixCache, KVAllocator]:
    allocator = _builtin_token_allocator(256)
    if kind == "none":
        return NoPrefixCache(allocator), allocator
    cache = RadixCache(allocator, page_size=1)
    for tokens in _CACHED:
        slots = allocator.alloc_extend([0], [len(tokens)], [-1])
        already = cache.insert(tokens, slots)
        allocator.free(slots[:already])
    # A running request holds the system prompt.
    cache.inc_lock_ref(cache.match_prefix(_SYSTEM)[1])
    return cache, allocator


def _builtin_token_allocator(size: int) -> KVAllocator:
    from treadle.core.registry import build_registry

    return build_registry().get("kv_allocators", "token")(size, 1, "cpu")


def _cache_state(cache: PrefixCache, allocator: KVAllocator) -> tuple:
    """What a cache holds, independent of how its nodes happen to be split."""
    sizes = (cache.evictable_size(), cache.protected_size(), allocator.free_slots)
    root = getattr(cache, "root", None)
    if root is None:
        return sizes, ()
    paths = []
    stack: list[tuple[Any, tuple]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        path = path + tuple(zip(node.key, node.value.tolist(), [node.lock_ref] * len(node.key)))
        if not node.children:
            paths.append(path)
        stack.extend((child, path) for child in node.children.values())
    return sizes, tuple(sorted(paths))


def _req_state(req: Req) -> tuple:
    return (
        req.rid,
        list(req.origin_input_ids),
        list(req.output_ids),
        req.kv_slots.tolist(),
        req.prefix_len,
        id(req.last_node),
        req.priority,
        req.arrival,
        req.sampling_params.max_new_tokens,
    )


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
