"""How the data-parallel controller picks a replica for each request (``parallel.dp_policy``).

- ``round_robin``: replicas in turn.
- ``shortest_queue``: the replica with the fewest unfinished requests routed to it.
- ``prefix_aware``: the replica whose prefix cache most likely holds the longest prefix of the prompt
  (tracked from what was routed, as chained hashes of fixed-size token blocks), unless that replica is
  much busier than the least loaded one; without a match, the shortest queue.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

DP_POLICIES = ("round_robin", "shortest_queue", "prefix_aware")

# Prompts are matched in blocks of this many tokens (a shorter shared prefix is not worth routing for).
PREFIX_BLOCK_TOKENS = 16
# Block hashes remembered per replica (least recently routed forgotten first): ~2M prompt tokens.
PREFIX_BLOCKS_PER_REPLICA = 1 << 17
# A prefix match is ignored when its replica has this many more unfinished requests than the idlest one.
PREFIX_MAX_IMBALANCE = 32


class ReplicaRouter:
    """Chooses a replica per request and keeps the per-replica load counts the policies read."""

    def __init__(self, policy: str, num_replicas: int) -> None:
        if policy not in DP_POLICIES:
            raise ValueError(f"unknown parallel.dp_policy '{policy}'; available: {', '.join(DP_POLICIES)}")
        self.policy = policy
        self.loads = [0] * num_replicas
        self.routed = [0] * num_replicas
        self._next = 0
        self._prefixes = [PrefixTracker() for _ in range(num_replicas)] if policy == "prefix_aware" else []

    def choose(self, input_ids: Sequence[int]) -> int:
        """The replica for a new request; counts it as routed there."""
        if self.policy == "round_robin":
            replica = self._next
            self._next = (self._next + 1) % len(self.loads)
        elif self.policy == "shortest_queue":
            replica = self._shortest_queue()
        else:
            replica = self._prefix_match(input_ids)
            self._prefixes[replica].add(input_ids)
        self.loads[replica] += 1
        self.routed[replica] += 1
        return replica

    def finished(self, replica: int, count: int = 1) -> None:
        self.loads[replica] = max(0, self.loads[replica] - count)

    def _shortest_queue(self) -> int:
        return min(range(len(self.loads)), key=lambda i: (self.loads[i], i))

    def _prefix_match(self, input_ids: Sequence[int]) -> int:
        fallback = self._shortest_queue()
        keys = block_keys(input_ids)
        best, best_blocks = fallback, 0
        for replica, tracker in enumerate(self._prefixes):
            blocks = tracker.matched_blocks(keys)
            if blocks > best_blocks or (blocks == best_blocks and blocks and replica == fallback):
                best, best_blocks = replica, blocks
        if best_blocks == 0 or self.loads[best] - self.loads[fallback] > PREFIX_MAX_IMBALANCE:
            return fallback
        return best


class PrefixTracker:
    """The prompt-prefix blocks routed to one replica, as chained block hashes in LRU order."""

    def __init__(self, capacity: int = PREFIX_BLOCKS_PER_REPLICA) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def add(self, input_ids: Sequence[int]) -> None:
        for key in block_keys(input_ids):
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def matched_blocks(self, keys: list[int]) -> int:
        """How many leading blocks of a prompt (given as its block keys) were routed here."""
        count = 0
        for key in keys:
            if key not in self._keys:
                break
            count += 1
        return count


def block_keys(input_ids: Sequence[int]) -> list[int]:
    """One key per full block; each key hashes the block and the key before it, so equal keys mean equal prefixes."""
    keys, previous = [], 0
    for start in range(0, len(input_ids) - PREFIX_BLOCK_TOKENS + 1, PREFIX_BLOCK_TOKENS):
        previous = hash((previous, tuple(input_ids[start:start + PREFIX_BLOCK_TOKENS])))
        keys.append(previous)
    return keys
