"""The plugin conformance kit (``treadle.testing``): built-ins pass it, broken plugins fail it."""

from __future__ import annotations

import random

import pytest
import torch

from treadle.core.registry import build_registry
from treadle.core.scheduling.policy import SchedulePolicy
from treadle.plugins.kv_allocators.paged import PagedKVAllocator
from treadle.plugins.kv_allocators.token import TokenKVAllocator
from treadle.testing import check_kv_allocator, check_schedule_policy


@pytest.mark.parametrize(
    ("factory", "page_size"),
    [(TokenKVAllocator, 1), (PagedKVAllocator, 1), (PagedKVAllocator, 4), (PagedKVAllocator, 16)],
)
def test_builtin_allocators_conform(factory, page_size):
    check_kv_allocator(factory, page_size)


@pytest.mark.parametrize("name", ["fcfs", "lpm", "random", "dfs-weight", "lof", "priority"])
def test_builtin_policies_conform(name):
    check_schedule_policy(build_registry().get("schedule_policies", name))


def test_the_example_plugin_policy_conforms():
    registry = build_registry()
    assert registry.table()["schedule_policies"]["shortest-prompt-first"] == "treadle-plugin-example"
    check_schedule_policy(registry.get("schedule_policies", "shortest-prompt-first"))


class LeakyAllocator(TokenKVAllocator):
    def free(self, slots):
        pass


class PartialWhenShortAllocator(TokenKVAllocator):
    def alloc_extend(self, prefix_lens, extend_lens, last_slots):
        if sum(extend_lens) > self.free_slots:
            super().alloc_extend([0], [1], [-1])  # takes a slot, then refuses
            return None
        return super().alloc_extend(prefix_lens, extend_lens, last_slots)


class HandsOutTwiceAllocator(TokenKVAllocator):
    def alloc_extend(self, prefix_lens, extend_lens, last_slots):
        slots = super().alloc_extend(prefix_lens, extend_lens, last_slots)
        if slots is not None and slots.numel() and self.free_slots < self.size - slots.numel():
            slots[0] = 1  # slot 1 is already held by an earlier request
        return slots


class FreshPageEveryCallAllocator(PagedKVAllocator):
    def alloc_extend(self, prefix_lens, extend_lens, last_slots):
        aligned = [length - length % self.page_size for length in prefix_lens]
        return super().alloc_extend(aligned, extend_lens, [-1] * len(prefix_lens))


class ContinuesAfterItsOwnFillAllocator(PagedKVAllocator):
    """Continues a partly filled page after the last slot it handed out there, not after ``last_slots``: right until
    a request gives back the tail of its KV (a verify step's rejected positions) and grows again."""

    def clear(self):
        super().clear()
        self.handed_out: dict[int, int] = {}  # page -> the last slot handed out in it

    def alloc_extend(self, prefix_lens, extend_lens, last_slots):
        page = self.page_size
        last = [self.handed_out.get(s // page, s) if s >= 0 else s for s in last_slots]
        prefix = [p + (mine - given) for p, mine, given in zip(prefix_lens, last, last_slots)]
        slots = super().alloc_extend(prefix, extend_lens, last)
        for slot in [] if slots is None else slots.tolist():
            self.handed_out[slot // page] = max(self.handed_out.get(slot // page, -1), slot)
        return slots

    def free(self, slots):
        super().free(slots)
        for p in torch.unique(slots // self.page_size).tolist():
            self.handed_out.pop(p, None)


@pytest.mark.parametrize(
    ("factory", "page_size", "message"),
    [
        (ContinuesAfterItsOwnFillAllocator, 4, "position p must sit at offset"),
        (LeakyAllocator, 1, "free_slots is"),
        (PartialWhenShortAllocator, 1, "returned None but free_slots changed"),
        (HandsOutTwiceAllocator, 1, "holds"),
        (FreshPageEveryCallAllocator, 4, "must"),
    ],
)
def test_broken_allocators_fail_the_kit(factory, page_size, message):
    with pytest.raises(AssertionError, match=message):
        check_kv_allocator(factory, page_size)


class DropsOnePolicy(SchedulePolicy):
    def __init__(self, seed=0):
        pass

    def order(self, waiting, tree_cache):
        return list(waiting[1:])


class UnseededPolicy(SchedulePolicy):
    def __init__(self, seed=0):
        pass

    def order(self, waiting, tree_cache):
        return random.sample(waiting, len(waiting))


class LockingPolicy(SchedulePolicy):
    def __init__(self, seed=0):
        pass

    def order(self, waiting, tree_cache):
        for req in waiting:
            tree_cache.inc_lock_ref(tree_cache.match_prefix(req.all_ids)[1])
        return list(waiting)


class RewritingPolicy(SchedulePolicy):
    def __init__(self, seed=0):
        pass

    def order(self, waiting, tree_cache):
        for req in waiting:
            req.kv_slots = torch.empty(0, dtype=torch.int64)
            req.priority += 1
        return list(waiting)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (DropsOnePolicy, "permutation"),
        (UnseededPolicy, "same seed"),
        (LockingPolicy, "prefix cache"),
        (RewritingPolicy, "requests' fields"),
        (lambda seed: object(), "not a SchedulePolicy"),
    ],
)
def test_broken_policies_fail_the_kit(factory, message):
    with pytest.raises(AssertionError, match=message):
        check_schedule_policy(factory)
