"""How the data-parallel controller picks a replica for each request (``parallel.dp_policy``).

- ``round_robin``: replicas in turn.
- ``shortest_queue``: the replica with the fewest unfinished requests routed to it (a count: a 16-token
  request weighs as much as a 1,000-token one).
- ``least_work``: the replica with the fewest tokens still to process among the requests routed to it (see
  :func:`request_work`): equal counts of unequal requests no longer leave one replica running long after the others.
- ``prefix_aware``: the replica whose prefix cache most likely holds the longest prefix of the prompt
  (tracked from what was routed, as chained hashes of fixed-size token blocks), unless that replica is
  much busier, in tokens, than the least loaded one; without a match, ``least_work``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

DP_POLICIES = ("round_robin", "shortest_queue", "least_work", "prefix_aware")

# Prompts are matched in blocks of this many tokens (a shorter shared prefix is not worth routing for).
PREFIX_BLOCK_TOKENS = 16
# Block hashes remembered per replica (least recently routed forgotten first): ~2M prompt tokens.
PREFIX_BLOCKS_PER_REPLICA = 1 << 17
# A prefix match is given up when its replica has more than this many tokens of work (beyond the prefill the match
# saves) over the least loaded one: ~16 requests of the `random` workload. A hot prompt then spreads to another replica.
PREFIX_MAX_IMBALANCE_TOKENS = 8192
# A request's output counts as at most this many tokens: one that asks for more, or leaves the length to the server
# (which then allows the whole context), counts as a typical answer; most stop at EOS long before their limit.
OUTPUT_TOKENS_CAP = 512


def request_work(prompt_tokens: int, max_new_tokens: int | None, cached_tokens: int = 0) -> int:
    """The tokens a replica processes for a request: its prompt less what the prefix cache holds, plus its output
    (``max_new_tokens``, capped at :data:`OUTPUT_TOKENS_CAP`; None counts as the cap)."""
    output = OUTPUT_TOKENS_CAP if max_new_tokens is None else min(max(max_new_tokens, 0), OUTPUT_TOKENS_CAP)
    return max(prompt_tokens - cached_tokens, 1) + output


@dataclass(frozen=True)
class Assignment:
    """Where one unfinished request went, and the work it was counted as there."""

    replica: int
    work: int


class ReplicaRouter:
    """Chooses a replica per request and keeps the per-replica loads the policies read: ``loads`` (unfinished
    requests) and ``work`` (their tokens, :func:`request_work`), both lowered as requests finish; ``routed`` and
    ``routed_work`` count everything ever sent to each replica."""

    def __init__(self, policy: str, num_replicas: int) -> None:
        if policy not in DP_POLICIES:
            raise ValueError(f"unknown parallel.dp_policy '{policy}'; available: {', '.join(DP_POLICIES)}")
        self.policy = policy
        self.loads = [0] * num_replicas
        self.work = [0] * num_replicas
        self.routed = [0] * num_replicas
        self.routed_work = [0] * num_replicas
        self.assigned: dict[str, Assignment] = {}
        self._next = 0
        self._prefixes = [PrefixTracker() for _ in range(num_replicas)] if policy == "prefix_aware" else []

    def choose(self, rid: str, input_ids: Sequence[int], max_new_tokens: int | None = None) -> int:
        """The replica for a new request ``rid``; counts it (and its work) there until :meth:`finished`."""
        self.finished(rid)  # a reused id replaces its earlier count
        cached = 0
        if self.policy == "round_robin":
            replica = self._next
            self._next = (self._next + 1) % len(self.loads)
        elif self.policy == "shortest_queue":
            replica = self._shortest_queue()
        elif self.policy == "least_work":
            replica = self._least_work()
        else:
            replica, cached = self._prefix_match(input_ids)
            self._prefixes[replica].add(input_ids)
        work = request_work(len(input_ids), max_new_tokens, cached)
        self.assigned[rid] = Assignment(replica, work)
        self.loads[replica] += 1
        self.work[replica] += work
        self.routed[replica] += 1
        self.routed_work[replica] += work
        return replica

    def replica_of(self, rid: str) -> int | None:
        """Where unfinished request ``rid`` went (None: unknown or finished)."""
        assignment = self.assigned.get(rid)
        return None if assignment is None else assignment.replica

    def finished(self, rid: str) -> int | None:
        """Request ``rid`` finished (or failed, or was aborted): its replica (returned; None for an unknown id) no
        longer counts it."""
        assignment = self.assigned.pop(rid, None)
        if assignment is None:
            return None
        self.loads[assignment.replica] -= 1
        self.work[assignment.replica] -= assignment.work
        return assignment.replica

    def _shortest_queue(self) -> int:
        return min(range(len(self.loads)), key=lambda i: (self.loads[i], i))

    def _least_work(self) -> int:
        return min(range(len(self.work)), key=lambda i: (self.work[i], self.loads[i], i))

    def _prefix_match(self, input_ids: Sequence[int]) -> tuple[int, int]:
        """The replica for a prompt, and the prompt tokens its prefix cache is expected to hold."""
        keys = block_keys(input_ids)
        matched = [tracker.matched_blocks(keys) * PREFIX_BLOCK_TOKENS for tracker in self._prefixes]
        fallback = self._least_work()
        # The longest match; among equal ones the least work.
        best = min(range(len(matched)), key=lambda i: (-matched[i], self.work[i], self.loads[i], i))
        if matched[best] == 0:
            return fallback, 0
        saved = matched[best] - matched[fallback]
        if self.work[best] - self.work[fallback] > PREFIX_MAX_IMBALANCE_TOKENS + saved:
            return fallback, matched[fallback]
        return best, matched[best]


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
