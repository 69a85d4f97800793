"""The built-in KV allocators: ``token`` (page size 1) and ``paged`` (page size N)."""

from __future__ import annotations

import pytest
import torch

from treadle.core.registry import build_registry
from treadle.plugins.kv_allocators.paged import PagedKVAllocator
from treadle.plugins.kv_allocators.token import TokenKVAllocator


def test_both_allocators_are_registered_by_name():
    registry = build_registry()
    assert registry.get("kv_allocators", "token") is TokenKVAllocator
    assert registry.get("kv_allocators", "paged") is PagedKVAllocator


def test_token_allocator_hands_out_distinct_real_slots_and_takes_them_back():
    allocator = TokenKVAllocator(10, 1)
    slots = allocator.alloc_extend([0, 3], [4, 2], [-1, 7])
    assert slots.dtype == torch.int64 and slots.device.type == "cpu"
    assert sorted(slots.tolist()) == list(range(1, 7))  # slot 0 is padding
    assert allocator.free_slots == 4
    allocator.free(slots[:4])
    assert allocator.free_slots == 8
    rest = allocator.alloc_extend([0], [8], [-1])
    assert set(rest.tolist()).isdisjoint(slots[4:].tolist())
    assert allocator.free_slots == 0


def test_token_allocator_hands_slots_back_out_first_freed_first_across_its_ring_end():
    allocator = TokenKVAllocator(8, 1)
    held = allocator.alloc_extend([0], [6], [-1]).tolist()  # 1..6
    allocator.free(torch.tensor([3, 1, 5, 2]))
    assert allocator.alloc_extend([0], [4], [-1]).tolist() == [7, 8, 3, 1]  # the ring's end, then its start
    allocator.free(torch.tensor([7, 8, 3]))
    assert allocator.alloc_extend([0], [5], [-1]).tolist() == [5, 2, 7, 8, 3]
    assert allocator.free_slots == 0
    allocator.free(torch.tensor([held[3], held[5], 1, 5, 2, 7, 8, 3]))  # written across the ring's end
    assert allocator.free_slots == 8 and sorted(allocator.alloc_extend([0], [8], [-1]).tolist()) == list(range(1, 9))


def test_token_allocator_refuses_without_allocating_when_short():
    allocator = TokenKVAllocator(5, 1)
    assert allocator.alloc_extend([0, 0], [3, 3], [-1, -1]) is None
    assert allocator.free_slots == 5
    assert allocator.alloc_extend([0], [5], [-1]).numel() == 5


def test_token_allocator_rejects_double_free_and_page_sizes_above_one():
    allocator = TokenKVAllocator(8, 1)
    slots = allocator.alloc_extend([0], [2], [-1])
    allocator.free(slots)
    with pytest.raises(ValueError, match="double free"):
        allocator.free(slots)
    with pytest.raises(ValueError, match="paged"):
        TokenKVAllocator(8, 4)


@pytest.mark.parametrize("count", [3, 100])  # checked in Python up to 64 slots, with tensor ops above
def test_token_allocator_refuses_repeated_padding_and_out_of_range_slots(count):
    allocator = TokenKVAllocator(256, 1)
    slots = allocator.alloc_extend([0], [count], [-1])
    repeated = torch.cat([slots[:-1], slots[:1]])
    padding = torch.cat([slots[1:], slots.new_zeros(1)])
    past_the_end = torch.cat([slots[1:], slots.new_full((1,), 257)])
    for bad, match in ((repeated, "double free"), (padding, "outside"), (past_the_end, "outside")):
        with pytest.raises(ValueError, match=match):
            allocator.free(bad)
        assert allocator.free_slots == 256 - count  # nothing was freed
    allocator.free(slots)
    assert allocator.free_slots == 256


def test_paged_allocator_continues_the_last_page_then_takes_fresh_pages():
    allocator = PagedKVAllocator(32, 4)  # pages 1..8; page 0 is padding
    first = allocator.alloc_extend([0], [6], [-1])
    assert (first // 4)[:4].unique().numel() == 1 and (first // 4)[4:].unique().numel() == 1
    assert (first % 4).tolist() == [0, 1, 2, 3, 0, 1]
    assert allocator.free_slots == 32 - 8
    more = allocator.alloc_extend([6], [3], [int(first[-1])])
    assert more[:2].tolist() == [int(first[-1]) + 1, int(first[-1]) + 2]  # fills the page
    assert more[2] % 4 == 0 and more[2] // 4 not in (first // 4).tolist()  # a fresh page at position 8
    assert allocator.free_slots == 32 - 12
    assert int(torch.cat([first, more]).min()) >= 4


def test_paged_allocator_decodes_into_fresh_pages_only_at_boundaries():
    allocator = PagedKVAllocator(16, 4)
    slots = allocator.alloc_extend([0, 0], [3, 4], [-1, -1])
    decoded = allocator.alloc_decode([3, 4], [int(slots[2]), int(slots[6])])
    assert decoded[0] == slots[2] + 1  # same page
    assert decoded[1] % 4 == 0 and decoded[1] // 4 != slots[6] // 4  # new page
    assert allocator.free_slots == 16 - 12


def test_paged_allocator_frees_the_pages_containing_the_slots():
    allocator = PagedKVAllocator(16, 4)
    slots = allocator.alloc_extend([0], [6], [-1])
    allocator.free(slots[4:])  # the partly used second page
    assert allocator.free_slots == 12
    allocator.free(slots[:2])
    assert allocator.free_slots == 16
    with pytest.raises(ValueError, match="double free"):
        allocator.free(slots[:1])


def test_paged_allocator_refuses_without_allocating_when_short():
    allocator = PagedKVAllocator(16, 4)
    held = allocator.alloc_extend([0], [9], [-1])  # 3 pages
    assert allocator.alloc_extend([0, 0], [1, 1], [-1, -1]) is None  # 2 pages, 1 free
    assert allocator.free_slots == 4
    # Continuing the held partial page needs no new page.
    assert allocator.alloc_extend([9], [3], [int(held[-1])]).numel() == 3
    assert allocator.free_slots == 4


def test_paged_allocator_rejects_a_last_slot_from_the_wrong_page_offset():
    allocator = PagedKVAllocator(16, 4)
    slots = allocator.alloc_extend([0], [2], [-1])
    with pytest.raises(ValueError, match="last_slots"):
        allocator.alloc_extend([2], [1], [int(slots[0])])
    assert allocator.free_slots == 12


def test_paged_allocator_rounds_the_pool_down_to_whole_pages():
    allocator = PagedKVAllocator(18, 4)
    assert allocator.total_slots == allocator.free_slots == 16
    allocator.alloc_extend([0], [16], [-1])
    allocator.clear()
    assert allocator.free_slots == 16
