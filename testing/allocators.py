"""``check_kv_allocator``: does a KVAllocator plugin hand out and account KV slots the way treadle relies on?"""

from __future__ import annotations

import random
from typing import Callable

import torch

from treadle.core.memory.allocator import KVAllocator

AllocatorFactory = Callable[[int, int, str], KVAllocator]


def check_kv_allocator(
    factory: AllocatorFactory,
    page_size: int,
    *,
    num_pages: int = 12,
    reference: AllocatorFactory | None = None,
    seed: int = 0,
) -> None:
    """Assert that ``factory(size, page_size, device)`` builds a conforming :class:`KVAllocator`.

    Checked, on a pool of ``num_pages`` pages:

    - ``total_slots``/``free_slots`` are exact after every ``alloc_extend``,
      ``alloc_decode``, ``free`` (also of part of a request's pages) and ``clear``;
    - a request shrinks (the slots of its positions from some length on are
      freed, whole pages past its last kept one, as after a verify step's
      rejected drafts) and grows again, continuing its partly filled page;
    - a request that does not fit returns None and allocates nothing;
    - no slot is handed out twice, slots are padding-free CPU int64 tensors;
    - with ``page_size > 1``: a request's positions ``kP .. kP+P-1`` share one
      page of its own, at offset ``position % P`` (partly filled pages are continued);
    - a seeded random trace of allocations and frees gives the same free-slot
      counts and the same refusals as ``reference`` (default: the built-in
      allocator for this page size, ``token`` or ``paged``, found through the registry).

    Raises AssertionError naming the broken rule.
    """
    name = getattr(factory, "__name__", repr(factory))
    size = num_pages * page_size
    _check_construction(factory, name, size, page_size)
    _check_alloc_and_free(_Ledger(factory(size, page_size, "cpu"), name))
    _check_short_request_has_no_side_effects(_Ledger(factory(size, page_size, "cpu"), name))
    _check_whole_pool(_Ledger(factory(size, page_size, "cpu"), name))
    _check_clear(_Ledger(factory(size, page_size, "cpu"), name))
    _check_shrink_and_regrow(_Ledger(factory(size, page_size, "cpu"), name))
    reference = reference or _builtin_reference(page_size)
    _check_trace_agrees(factory, name, reference, size, page_size, seed)


class _Ledger:
    """Drives one allocator as a set of requests and checks every answer against exact accounting."""

    def __init__(self, allocator: KVAllocator, name: str) -> None:
        _expect(isinstance(allocator, KVAllocator), f"{name} built a {type(allocator).__name__}, not a KVAllocator")
        self.allocator = allocator
        self.name = name
        self.page = allocator.page_size
        self.total = allocator.total_slots
        self.slots: dict[str, torch.Tensor] = {}
        # Which request holds each slot (-1: none); pages are owned whole, so mark whole pages.
        self.owner = torch.full((self.total + self.page,), -1, dtype=torch.int64)
        self.ids: dict[str, int] = {}

    def expected_free(self) -> int:
        pages = sum(-(-s.numel() // self.page) for s in self.slots.values())
        return self.total - pages * self.page

    def extend(self, lens: dict[str, int], decode: bool = False) -> bool:
        """Allocate ``lens[r]`` more positions for each request ``r``; False when refused."""
        names = list(lens)
        prefix_lens = [self._len(r) for r in names]
        last_slots = [int(self.slots[r][-1]) if self._len(r) else -1 for r in names]
        before = self.allocator.free_slots
        if decode:
            got = self.allocator.alloc_decode(prefix_lens, last_slots)
        else:
            got = self.allocator.alloc_extend(prefix_lens, [lens[r] for r in names], last_slots)
        what = f"{self.name}.{'alloc_decode' if decode else 'alloc_extend'}(prefix_lens={prefix_lens}, " \
               f"extend_lens={[lens[r] for r in names]})"
        if got is None:
            _expect(
                self.allocator.free_slots == before,
                f"{what} returned None but free_slots changed {before} -> {self.allocator.free_slots}",
            )
            return False
        self._check_slots(what, got, sum(lens.values()))
        start = 0
        for r in names:
            new = got[start : start + lens[r]]
            start += lens[r]
            self._take(what, r, new)
        self._check_free(what)
        return True

    def release(self, r: str, in_two_calls: bool = False) -> None:
        slots = self.slots.pop(r)
        if in_two_calls and slots.numel() > self.page:
            # Free the first whole pages, then the rest, as the radix cache frees duplicates and tails.
            cut = (slots.numel() // 2) // self.page * self.page or self.page
            self.allocator.free(slots[:cut])
            self.allocator.free(slots[cut:])
        else:
            self.allocator.free(slots)
        pages = torch.unique(slots // self.page)
        self.owner[(pages * self.page).unsqueeze(1) + torch.arange(self.page)] = -1
        self._check_free(f"{self.name}.free(<{slots.numel()} slots of request {r}>)")

    def shrink(self, r: str, length: int) -> None:
        """Give back request ``r``'s positions from ``length`` on, as the scheduler does with a verify step's
        rejected positions: the slots of the whole pages past its last kept position."""
        slots = self.slots[r]
        cut = -(-length // self.page) * self.page
        freed = slots[cut:]
        if freed.numel():
            self.allocator.free(freed)
            pages = torch.unique(freed // self.page)
            self.owner[(pages * self.page).unsqueeze(1) + torch.arange(self.page)] = -1
        self.slots[r] = slots[:length]
        self._check_free(f"{self.name}.free(<the {freed.numel()} slots of request {r} past position {length}>)")

    def clear(self) -> None:
        self.allocator.clear()
        self.slots.clear()
        self.owner.fill_(-1)
        self._check_free(f"{self.name}.clear()")
        _expect(self.allocator.free_slots == self.total, f"{self.name}.clear() left free_slots != total_slots")

    def _len(self, r: str) -> int:
        return int(self.slots[r].numel()) if r in self.slots else 0

    def _check_slots(self, what: str, got: torch.Tensor, count: int) -> None:
        _expect(isinstance(got, torch.Tensor), f"{what} returned {type(got).__name__}, not a torch.Tensor")
        _expect(got.dtype == torch.int64, f"{what} returned dtype {got.dtype}; slots must be int64")
        _expect(got.device.type == "cpu", f"{what} returned slots on {got.device}; slots must be on the host (cpu)")
        _expect(got.dim() == 1 and got.numel() == count, f"{what} returned shape {tuple(got.shape)}, expected ({count},)")
        if count:
            low, high = int(got.min()), int(got.max())
            _expect(
                low >= self.page and high < self.page + self.total,
                f"{what} returned slots in [{low}, {high}], outside the real slots "
                f"[{self.page}, {self.page + self.total}) (slots below page_size are padding)",
            )
            _expect(torch.unique(got).numel() == count, f"{what} handed out the same slot twice in one call")

    def _take(self, what: str, r: str, new: torch.Tensor) -> None:
        rid = self.ids.setdefault(r, len(self.ids))
        held_by_other = (self.owner[new] != -1) & (self.owner[new] != rid)
        _expect(not bool(held_by_other.any()), f"{what} handed out slots that another request still holds")
        old = self.slots.get(r, torch.empty(0, dtype=torch.int64))
        _expect(not bool(torch.isin(new, old).any()), f"{what} handed request {r} a slot it already holds")
        slots = torch.cat([old, new])
        self.slots[r] = slots
        if self.page > 1:
            positions = torch.arange(slots.numel())
            _expect(
                bool((slots % self.page == positions % self.page).all()),
                f"{what}: position p must sit at offset p % {self.page} of its page; request {r} got "
                f"offsets {(slots % self.page).tolist()}",
            )
            same_position_page = positions[1:] // self.page == positions[:-1] // self.page
            same_slot_page = slots[1:] // self.page == slots[:-1] // self.page
            _expect(
                bool((same_slot_page | ~same_position_page).all()),
                f"{what}: positions of one page must share one KV page (continue the partly filled last "
                f"page from last_slots + 1); request {r} got slots {slots.tolist()}",
            )
        pages = torch.unique(new // self.page)
        self.owner[(pages * self.page).unsqueeze(1) + torch.arange(self.page)] = rid

    def _check_free(self, what: str) -> None:
        expected = self.expected_free()
        _expect(
            self.allocator.free_slots == expected,
            f"after {what}: free_slots is {self.allocator.free_slots}, expected exactly {expected} "
            f"(total_slots {self.total} minus whole pages held)",
        )


def _check_construction(factory: AllocatorFactory, name: str, size: int, page: int) -> None:
    allocator = factory(size, page, "cpu")
    _expect(isinstance(allocator, KVAllocator), f"{name} built a {type(allocator).__name__}, not a KVAllocator")
    _expect(allocator.page_size == page, f"{name}(page_size={page}) reports page_size {allocator.page_size}")
    _expect(allocator.total_slots == size, f"{name}(size={size}) reports total_slots {allocator.total_slots}")
    _expect(allocator.free_slots == size, f"a new {name} reports free_slots {allocator.free_slots}, not {size}")
    if page > 1:
        ragged = factory(size + page - 1, page, "cpu")
        _expect(
            ragged.total_slots == size,
            f"{name}(size={size + page - 1}, page_size={page}) must round down to whole pages "
            f"(total_slots {size}), got {ragged.total_slots}",
        )
    empty = allocator.alloc_extend([], [], [])
    _expect(
        empty is not None and empty.numel() == 0 and allocator.free_slots == size,
        f"{name}.alloc_extend of no requests must return an empty tensor and allocate nothing",
    )


def _check_alloc_and_free(ledger: _Ledger) -> None:
    page = ledger.page
    _expect(ledger.extend({"a": 1, "b": page + 1, "c": 2 * page}), f"{ledger.name} refused a request that fits")
    _expect(ledger.extend({"a": 1, "b": 1}, decode=True), f"{ledger.name} refused a decode that fits")
    _expect(ledger.extend({"a": 3 * page - 1}), f"{ledger.name} refused an extend that fits")
    ledger.release("b")
    _expect(ledger.extend({"c": 1, "d": page}), f"{ledger.name} refused a request after a free")
    ledger.release("a", in_two_calls=True)
    ledger.release("c")
    ledger.release("d")
    _expect(ledger.allocator.free_slots == ledger.total, f"{ledger.name} leaked slots: not all free after freeing all")


def _check_short_request_has_no_side_effects(ledger: _Ledger) -> None:
    page, total = ledger.page, ledger.total
    _expect(ledger.extend({"x": total - page}), f"{ledger.name} refused a request that fits")
    # One page is left.
    _expect(not ledger.extend({"y": page + 1}), f"{ledger.name} allocated {page + 1} slots with only {page} free")
    _expect(not ledger.extend({"y": page, "z": 1}), f"{ledger.name} allocated 2 pages with only 1 free")
    _expect(ledger.extend({"y": page}), f"{ledger.name} refused a request for exactly the free slots")
    _expect(ledger.allocator.free_slots == 0, f"{ledger.name} has free slots left in a full pool")
    _expect(not ledger.extend({"z": 1}), f"{ledger.name} allocated a slot from a full pool")
    ledger.release("x")
    ledger.release("y")


def _check_whole_pool(ledger: _Ledger) -> None:
    total, page = ledger.total, ledger.page
    _expect(ledger.extend({"all": total}), f"{ledger.name} refused one request for the whole pool ({total} slots)")
    _expect(not ledger.extend({"all": 1}, decode=True), f"{ledger.name} decoded past a full pool")
    ledger.release("all", in_two_calls=True)
    # Grow one request a token at a time across page boundaries, then fill the pool.
    for _ in range(2 * page + 1):
        _expect(ledger.extend({"grow": 1}, decode=True), f"{ledger.name} refused a decode that fits")
    _expect(ledger.extend({"grow": total - ledger._len("grow")}), f"{ledger.name} refused the rest of the pool")
    ledger.release("grow")


def _check_clear(ledger: _Ledger) -> None:
    page = ledger.page
    _expect(ledger.extend({"a": page + 1, "b": 2}), f"{ledger.name} refused a request that fits")
    ledger.clear()
    _expect(ledger.extend({"all": ledger.total}), f"{ledger.name} cannot hand out the whole pool after clear()")
    ledger.release("all")


def _check_shrink_and_regrow(ledger: _Ledger) -> None:
    page = ledger.page
    _expect(ledger.extend({"a": 2 * page + 1, "b": page}), f"{ledger.name} refused a request that fits")
    ledger.shrink("a", page + 1)  # keeps a partly filled page (page size > 1)
    _expect(ledger.extend({"a": page + 2, "b": 3}),
            f"{ledger.name} refused to grow a request again after giving back its tail")
    ledger.shrink("a", 2 * page)  # at a page boundary: every page past it goes back
    ledger.shrink("b", 0)
    _expect(ledger.extend({"a": 1, "b": 1}, decode=True), f"{ledger.name} refused a decode after a shrink")
    ledger.release("a")
    ledger.release("b")
    _expect(ledger.allocator.free_slots == ledger.total, f"{ledger.name} leaked slots after shrinking requests")


def _check_trace_agrees(
    factory: AllocatorFactory, name: str, reference: AllocatorFactory, size: int, page: int, seed: int
) -> None:
    ref_name = getattr(reference, "__name__", repr(reference))
    subject = _Ledger(factory(size, page, "cpu"), name)
    oracle = _Ledger(reference(size, page, "cpu"), ref_name)
    rng = random.Random(seed)
    next_id = 0
    for step in range(150):
        live = sorted(subject.slots)
        if live and rng.random() < 0.3:
            r = rng.choice(live)
            subject.release(r, in_two_calls=rng.random() < 0.5)
            oracle.release(r)
            continue
        if live and rng.random() < 0.15:  # rejected positions of a verify step
            r = rng.choice(live)
            length = rng.randint(max(0, subject._len(r) - page - 2), subject._len(r))
            subject.shrink(r, length)
            oracle.shrink(r, length)
            continue
        decode = bool(live) and rng.random() < 0.3
        if decode:
            lens = {r: 1 for r in rng.sample(live, rng.randint(1, len(live)))}
        else:
            names = rng.sample(live, min(len(live), rng.randint(0, 2)))
            while len(names) < 3 and rng.random() < 0.6 or not names:
                names.append(f"r{next_id}")
                next_id += 1
            lens = {r: rng.randint(1, 2 * page + 2) for r in names}
        granted = subject.extend(lens, decode)
        expected = oracle.extend(lens, decode)
        _expect(
            granted == expected,
            f"trace step {step}: {name} {'granted' if granted else 'refused'} {lens} while the reference "
            f"{ref_name} {'granted' if expected else 'refused'} it (free_slots {subject.allocator.free_slots} vs "
            f"{oracle.allocator.free_slots})",
        )
        _expect(
            subject.allocator.free_slots == oracle.allocator.free_slots,
            f"trace step {step}: free_slots {subject.allocator.free_slots} differs from the reference "
            f"{ref_name}'s {oracle.allocator.free_slots}",
        )


def _builtin_reference(page_size: int) -> AllocatorFactory:
    from treadle.core.registry import build_registry

    return build_registry().get("kv_allocators", "token" if page_size == 1 else "paged")


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
