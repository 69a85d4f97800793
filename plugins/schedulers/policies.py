"""The built-in schedule policies: fcfs, lpm, random, dfs-weight, lof and priority.

Every policy returns a new list and leaves the waiting list, the requests and
the prefix cache's contents alone. The two prefix-aware policies (lpm,
dfs-weight) call ``tree_cache.match_prefix``, which refreshes the matched
nodes' ``last_access`` (so queued requests' prefixes count as recently used
for LRU eviction) and may split a radix node at the match point; neither
changes which tokens are cached, their slots, or the evictable/protected sizes.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

from treadle.core.hookspecs import hookimpl
from treadle.core.memory.radix_cache import PrefixCache
from treadle.core.request import Req
from treadle.core.scheduling.policy import SchedulePolicy

# Matching every waiting request against the tree costs a walk each; past this
# many waiting requests the prefix-aware policies fall back to arrival order.
MAX_PREFIX_MATCHED_QUEUE = 128


class FCFSPolicy(SchedulePolicy):
    """First come, first served: by ``Req.arrival``."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def order(self, waiting: list[Req], tree_cache: PrefixCache) -> list[Req]:
        return sorted(waiting, key=_arrival)


class LongestPrefixMatchPolicy(SchedulePolicy):
    """Longest cached prefix first (ties by arrival): reuses the radix cache before it is evicted.

    With a cache that matches nothing (NoPrefixCache) every length is 0, so it is fcfs;
    so it is with more than MAX_PREFIX_MATCHED_QUEUE requests waiting.
    """

    uses_prefix_cache = True

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def order(self, waiting: list[Req], tree_cache: PrefixCache) -> list[Req]:
        if len(waiting) > MAX_PREFIX_MATCHED_QUEUE:
            return sorted(waiting, key=_arrival)
        # Each request matches among its own adapter's prefixes (lora_uid: None for the base model).
        prefix_lens = {id(req): int(tree_cache.match_prefix(req.all_ids, req.lora_uid)[0].numel())
                       for req in waiting}
        return sorted(waiting, key=lambda req: (-prefix_lens[id(req)], req.arrival))


class RandomPolicy(SchedulePolicy):
    """A seeded random shuffle; the same seed and the same sequence of queues give the same orders."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._rng = random.Random(seed)

    def order(self, waiting: list[Req], tree_cache: PrefixCache) -> list[Req]:
        shuffled = sorted(waiting, key=_arrival)
        self._rng.shuffle(shuffled)
        return shuffled


class DFSWeightPolicy(SchedulePolicy):
    """Admit requests that share prefixes together (SGLang's DFS-weight idea).

    Each request sits at the radix node its cached prefix ends at. A node's
    weight is the number of waiting requests at it or below it. A depth-first
    walk from the root visits heavier children first (ties: the child whose
    subtree holds the earliest arrival) and emits a node's own requests after
    its children's (by arrival), so the deepest shared prefixes go first and
    requests with nothing cached come last. With NoPrefixCache it is fcfs.
    """

    uses_prefix_cache = True

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def order(self, waiting: list[Req], tree_cache: PrefixCache) -> list[Req]:
        if len(waiting) > MAX_PREFIX_MATCHED_QUEUE:
            return sorted(waiting, key=_arrival)
        reqs_at: dict[int, list[Req]] = defaultdict(list)
        nodes: dict[int, Any] = {}
        for req in sorted(waiting, key=_arrival):
            node = tree_cache.match_prefix(req.all_ids, req.lora_uid)[1]
            nodes[id(node)] = node
            reqs_at[id(node)].append(req)
        if len(nodes) <= 1:
            return sorted(waiting, key=_arrival)

        # Weights and the subtree of the tree that leads to a waiting request.
        weight: dict[int, int] = defaultdict(int)
        first_arrival: dict[int, int] = {}
        children: dict[int, dict[int, Any]] = defaultdict(dict)
        roots: dict[int, Any] = {}
        for node_id, node in nodes.items():
            count = len(reqs_at[node_id])
            earliest = reqs_at[node_id][0].arrival
            while True:
                key = id(node)
                weight[key] += count
                first_arrival[key] = min(first_arrival.get(key, earliest), earliest)
                parent = getattr(node, "parent", None)
                if parent is None:
                    roots[key] = node
                    break
                children[id(parent)][key] = node
                node = parent

        def by_weight(node: Any) -> tuple[int, int]:
            return -weight[id(node)], first_arrival[id(node)]

        ordered: list[Req] = []
        # Iterative post-order: a node's requests follow all of its children's.
        stack: list[tuple[Any, bool]] = [(root, False) for root in sorted(roots.values(), key=by_weight, reverse=True)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                ordered.extend(reqs_at.get(id(node), ()))
                continue
            stack.append((node, True))
            for child in sorted(children[id(node)].values(), key=by_weight, reverse=True):
                stack.append((child, False))
        return ordered


class LongestOutputFirstPolicy(SchedulePolicy):
    """Largest ``sampling_params.max_new_tokens`` first, ties by arrival."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def order(self, waiting: list[Req], tree_cache: PrefixCache) -> list[Req]:
        return sorted(waiting, key=lambda req: (-req.sampling_params.max_new_tokens, req.arrival))


class PriorityPolicy(SchedulePolicy):
    """Larger ``Req.priority`` first, ties by arrival."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def order(self, waiting: list[Req], tree_cache: PrefixCache) -> list[Req]:
        return sorted(waiting, key=lambda req: (-req.priority, req.arrival))


def _arrival(req: Req) -> int:
    return req.arrival


@hookimpl
def treadle_register_schedule_policies(register) -> None:
    register("fcfs", FCFSPolicy)
    register("lpm", LongestPrefixMatchPolicy)
    register("random", RandomPolicy)
    register("dfs-weight", DFSWeightPolicy)
    register("lof", LongestOutputFirstPolicy)
    register("priority", PriorityPolicy)
