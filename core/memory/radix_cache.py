"""Prefix caches: the radix tree that shares KV of common prefixes, and its null twin.

A ``RadixCache`` maps token-id sequences to the KV slots that hold them. A
finished (or partly prefilled) request inserts its computed tokens; a new
request matches its longest cached prefix and skips recomputing it. Nodes in
use are reference-counted (``lock_ref``, propagated to the root); unlocked
leaves are evicted least-recently-used first when the allocator runs short.
With ``page_size`` P > 1 the tree holds whole pages only and matches in whole
pages, because a page's slots cannot be shared in part.

``NoPrefixCache`` is the same interface with nothing cached
(``cache.disable_radix_cache: true``).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Iterator

import torch

from treadle.core.memory.allocator import KVAllocator

if TYPE_CHECKING:
    from treadle.core.request import Req


class PrefixCache(ABC):
    """What the scheduler needs from a prefix cache; see :class:`RadixCache` for the semantics."""

    page_size: int

    @abstractmethod
    def match_prefix(self, token_ids: list[int], namespace: Any = None) -> tuple[torch.Tensor, Any]:
        """The cached slots (CPU int64) of the longest page-aligned cached prefix, and its node. ``namespace``:
        whose prefixes to look among (a LoRA adapter's registration; None: the base model's)."""

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect ``node`` and its ancestors from eviction."""

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one :meth:`inc_lock_ref`."""

    @abstractmethod
    def insert(self, token_ids: list[int], slots: torch.Tensor, namespace: Any = None) -> int:
        """Cache the whole pages of ``token_ids`` at ``slots``; return the length already present before."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` unlocked cached slots if possible; return how many were freed."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Cached tokens no request holds (they can be evicted)."""

    @abstractmethod
    def protected_size(self) -> int:
        """Cached tokens locked by running requests."""

    @abstractmethod
    def cache_finished_req(self, req: "Req") -> None:
        """Hand a finished request's KV to the cache: insert, free duplicates and the unaligned tail, unlock."""

    @abstractmethod
    def cache_unfinished_req(self, req: "Req") -> None:
        """Insert what a still-running request has computed and re-point its prefix at the cached copy."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every cached entry, giving its slots back to the allocator."""


class TreeNode:
    """One edge of the radix tree: tokens ``key`` whose KV lives at slots ``value``."""

    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: torch.Tensor, parent: "TreeNode | None", last_access: int) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        # Keyed by the node's first token (page size 1) or first page (a tuple).
        self.children: dict[Any, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = last_access

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"


class RadixCache(PrefixCache):
    """A radix tree over token ids whose nodes own the KV slots of their tokens.

    Slots enter the tree through :meth:`insert` (the tree then owns them) and
    leave only through :meth:`evict` or :meth:`reset`, which hand them to
    ``allocator.free``. ``evictable_size() + protected_size()`` is exactly the
    number of slots the tree owns.

    Eviction candidates live in a heap ordered by ``last_access`` that is kept
    lazily: a node is pushed when it becomes an unlocked leaf (inserted,
    unlocked, or its last child evicted), and an entry is checked when popped —
    dropped if the node left the tree, has children or is locked, pushed again
    if the node was used since. An eviction so costs the leaves it frees (and
    the stale entries it meets), not a walk over the whole tree.
    """

    def __init__(self, allocator: KVAllocator, page_size: int) -> None:
        if page_size != allocator.page_size:
            raise ValueError(
                f"RadixCache page_size {page_size} differs from the allocator's page size {allocator.page_size}; "
                "they must be equal"
            )
        self.allocator = allocator
        self.page_size = page_size
        self._clock = itertools.count(1)
        self._new_tree()

    # -- lookup and insertion ------------------------------------------------------------

    def match_prefix(self, token_ids: list[int], namespace: Any = None) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached page-aligned prefix of ``token_ids``: its slots and the node where it ends.

        A match that ends inside a node splits that node so the returned node
        covers exactly the match (the cached content and sizes do not change).
        Every node on the path gets a fresh ``last_access``. Each ``namespace`` (a LoRA adapter's registration)
        has a tree of its own under the root, so prefixes computed under one are never matched under another.
        """
        end = len(token_ids) - len(token_ids) % self.page_size
        now = next(self._clock)
        node = self._namespace_root(namespace)
        node.last_access = now
        pieces: list[torch.Tensor] = []
        pos = 0
        while pos < end:
            child = node.children.get(self._child_key(token_ids, pos))
            if child is None:
                break
            matched = self._match_len(child.key, token_ids, pos, end)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = now
            pieces.append(child.value)
            node = child
            pos += matched
        slots = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
        return slots, node

    def insert(self, token_ids: list[int], slots: torch.Tensor, namespace: Any = None) -> int:
        """Cache the whole pages of ``token_ids`` at ``slots``.

        Returns how many leading tokens were already cached (a multiple of the
        page size). The tree takes ownership of ``slots[returned:aligned]``;
        the caller still owns ``slots[:returned]`` (duplicates of what the tree
        holds, unless they are the tree's own) and any unaligned tail.
        """
        end = len(token_ids) - len(token_ids) % self.page_size
        if slots.numel() < end:
            raise ValueError(f"insert got {len(token_ids)} token ids but only {slots.numel()} slots")
        now = next(self._clock)
        node = self._namespace_root(namespace)
        node.last_access = now
        pos = 0
        while pos < end:
            key = self._child_key(token_ids, pos)
            child = node.children.get(key)
            if child is None:
                value = slots[pos:end].to(device="cpu", dtype=torch.int64).clone()
                leaf = TreeNode(list(token_ids[pos:end]), value, node, now)
                node.children[key] = leaf
                self._evictable += end - pos
                self._num_nodes += 1
                self._push(leaf)
                return pos
            matched = self._match_len(child.key, token_ids, pos, end)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = now
            node = child
            pos += matched
        return pos

    # -- reference counts -----------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode | None) -> None:
        while node is not None and node.parent is not None:  # up to a root (the base's or a namespace's)
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode | None) -> None:
        while node is not None and node.parent is not None:
            if node.lock_ref == 0:
                raise RuntimeError(f"dec_lock_ref on an unlocked node {node!r}: lock and unlock calls are unbalanced")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
                if not node.children:
                    self._push(node)
            node = node.parent

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    # -- eviction -------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until ``num_tokens`` slots are freed.

        Frees whole nodes, so it may free more than asked; returns the number
        freed (less than asked only when nothing evictable is left).
        """
        heap = self._heap
        freed_values: list[torch.Tensor] = []
        freed = 0
        while freed < num_tokens and heap:
            last_access, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None or leaf.children or leaf.lock_ref:
                continue  # evicted already, or no evictable leaf now: pushed again when it becomes one
            if last_access != leaf.last_access:
                self._push(leaf)  # used since it was pushed: back in at its new age
                continue
            del parent.children[self._child_key(leaf.key, 0)]
            leaf.parent = None
            self._num_nodes -= 1
            freed_values.append(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                self._push(parent)
        if freed_values:
            self.allocator.free(torch.cat(freed_values))
        return freed

    def reset(self) -> None:
        """Free every cached slot and start with an empty tree; no request may hold a lock."""
        if self._protected:
            raise RuntimeError(
                f"cannot reset the radix cache while running requests lock {self._protected} cached tokens; "
                "finish or abort them first"
            )
        values = [node.value for node in self._nodes()]
        if values:
            self.allocator.free(torch.cat(values))
        self._new_tree()

    # -- requests -------------------------------------------------------------------------

    def cache_finished_req(self, req: "Req") -> None:
        """Insert the request's computed tokens and release everything it still owns.

        Afterwards the request owns no slots: its page-aligned KV is in the tree
        (or freed as a duplicate of what the tree already had), its unaligned
        tail is freed, and its lock on ``req.last_node`` is dropped.
        """
        slots = req.kv_slots
        aligned = self._insert_computed(req)
        self.allocator.free(slots[aligned:])
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: "Req") -> None:
        """Insert the request's computed whole pages and make it use the tree's copy of them.

        Sets ``req.kv_slots[:aligned]`` to the tree's slots (they differ where
        another request cached the same tokens first; the request's duplicates
        are freed), ``req.prefix_len = aligned`` and ``req.last_node`` to the
        newly locked node. The unaligned tail stays the request's own. The
        caller must rewrite the request's ``req_to_token`` row from ``req.kv_slots``.
        """
        slots = req.kv_slots
        aligned = self._insert_computed(req)
        cached_slots, node = self.match_prefix(req.all_ids[:aligned], req.lora_uid)
        if cached_slots.numel() != aligned:
            raise RuntimeError(f"radix cache lost tokens: inserted {aligned}, matched {cached_slots.numel()}")
        self.inc_lock_ref(node)
        self.dec_lock_ref(req.last_node)
        req.kv_slots = torch.cat([cached_slots, slots[aligned:]])
        req.prefix_len = aligned
        req.last_node = node

    def _insert_computed(self, req: "Req") -> int:
        """Insert the whole pages of ``req``'s computed tokens, free its duplicates, return the aligned length."""
        kv_len = req.kv_len
        aligned = kv_len - kv_len % self.page_size
        already = self.insert(req.all_ids[:aligned], req.kv_slots[:aligned], req.lora_uid)
        if already < req.prefix_len:
            raise RuntimeError(
                f"request {req.rid}: its locked prefix of {req.prefix_len} tokens is no longer cached "
                f"(found {already}); was last_node unlocked early?"
            )
        # The tree already had [prefix_len, already) from another request; these copies are surplus.
        self.allocator.free(req.kv_slots[req.prefix_len : already])
        return aligned

    # -- tree helpers -----------------------------------------------------------------------

    def _new_tree(self) -> None:
        self.root = TreeNode([], torch.empty(0, dtype=torch.int64), None, next(self._clock))
        # The roots of the namespaces' trees (parentless, like the root, so locks and eviction stop at them).
        self._namespaces: dict[Any, TreeNode] = {}
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 0
        # (last_access when pushed, push order, node): eviction candidates, checked when popped (see the class).
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._push_order = itertools.count()

    def _push(self, node: TreeNode) -> None:
        if len(self._heap) > 2 * self._num_nodes + 1024:
            # Mostly stale entries (a tree that is seldom evicted from): rebuild from the tree, once per
            # that many pushes, so the heap stays proportional to the tree.
            self._heap = [(n.last_access, next(self._push_order), n) for n in self._nodes()
                          if not n.children and n.lock_ref == 0]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (node.last_access, next(self._push_order), node))

    def _namespace_root(self, namespace: Any) -> TreeNode:
        if namespace is None:
            return self.root
        root = self._namespaces.get(namespace)
        if root is None:
            root = self._namespaces[namespace] = TreeNode([], torch.empty(0, dtype=torch.int64), None,
                                                          next(self._clock))
        return root

    def _child_key(self, token_ids: list[int], pos: int) -> Any:
        if self.page_size == 1:
            return token_ids[pos]
        return tuple(token_ids[pos : pos + self.page_size])

    def _match_len(self, key: list[int], token_ids: list[int], pos: int, end: int) -> int:
        """Length of the common prefix of ``key`` and ``token_ids[pos:end]``, in whole pages."""
        n = min(len(key), end - pos)
        if key[:n] != token_ids[pos : pos + n]:
            n = next(i for i in range(n) if key[i] != token_ids[pos + i])
        return n - n % self.page_size

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut ``child`` after ``at`` tokens; return the new upper node (same lock count and age)."""
        upper = TreeNode(child.key[:at], child.value[:at], child.parent, child.last_access)
        upper.lock_ref = child.lock_ref
        self._num_nodes += 1
        assert child.parent is not None
        child.parent.children[self._child_key(child.key, 0)] = upper
        child.key = child.key[at:]
        child.value = child.value[at:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        return upper

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node except the root."""
        stack = [child for root in (self.root, *self._namespaces.values()) for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


class NoPrefixCache(PrefixCache):
    """The prefix cache that caches nothing (``cache.disable_radix_cache: true``).

    Matches are always empty, a finished request's slots are all freed, and
    :meth:`insert` takes ownership of nothing (it reports every token as
    already present, so the caller frees its own slots as duplicates).
    """

    def __init__(self, allocator: KVAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size

    def match_prefix(self, token_ids: list[int], namespace: Any = None) -> tuple[torch.Tensor, None]:
        return torch.empty(0, dtype=torch.int64), None

    def inc_lock_ref(self, node: Any) -> None:
        pass

    def dec_lock_ref(self, node: Any) -> None:
        pass

    def insert(self, token_ids: list[int], slots: torch.Tensor, namespace: Any = None) -> int:
        return len(token_ids)

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def cache_finished_req(self, req: "Req") -> None:
        self.allocator.free(req.kv_slots)

    def cache_unfinished_req(self, req: "Req") -> None:
        pass

    def reset(self) -> None:
        pass
