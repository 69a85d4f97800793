"""LoRAManager: which adapters are known, which are kept in host memory, which sit in the device slots.

- **Known** adapters are names with folders: ``lora.paths`` at start, then :meth:`LoRAManager.add` /
  :meth:`LoRAManager.remove` at run time. A request names one (``Req.lora_name``); an unknown name is a 400 that
  lists the known ones.
- **Loaded** adapters are read into host memory; at most ``lora.max_loaded_loras`` stay there, the least recently
  used one that no request is using evicted first (and read again from its folder when next asked for).
- **Resident** adapters occupy one of ``lora.max_loras_per_batch`` device slots (core/lora/slots.py). Admission
  calls :meth:`acquire` for a request: its adapter's slot (shared with the other requests using it), or a free one
  loaded now, or, when every slot is used by running requests, False: the request waits. :meth:`release` gives a
  request's hold back when it ends or is retracted.

Each registration of a name gets a new ``uid``: the radix cache's namespace for the prefixes computed under it, so
a prefix computed under one adapter is never reused under another, the base model, or a later adapter of the same
name.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from treadle.core.execution.batch_context import NO_ADAPTER
from treadle.core.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter, read_adapter_rank
from treadle.core.lora.slots import build_layers, projection_shapes, projections_by_name

logger = logging.getLogger(__name__)

DEFAULT_MAX_RANK = 16


@dataclass
class KnownAdapter:
    """A name a request may ask for: its folder and the namespace of its cached prefixes."""

    name: str
    path: str
    uid: int
    rank: int


class LoRAManager:
    """Adapters for one model (see the module docstring); built before CUDA graphs are captured."""

    def __init__(self, lora_config: Any, model: nn.Module, registry: Any, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = lora_config
        self.device, self.dtype = device, dtype
        self.shapes = projection_shapes(model)
        self.max_rank = resolve_max_rank(lora_config)
        self.backend_name = choose_backend(lora_config.backend, registry, device)
        factory = registry.get("lora_backends", self.backend_name)
        self.num_slots = int(lora_config.max_loras_per_batch)
        self.backend = factory(self.num_slots, self.max_rank, device, dtype)
        self.layers = build_layers(model, self.backend, self.num_slots, self.max_rank, device, dtype)
        self.projections = projections_by_name(self.layers)
        self.max_loaded = lora_config.max_loaded_loras
        self.known: dict[str, KnownAdapter] = {}
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slot_names: list[str | None] = [None] * self.num_slots
        self.slot_users = [0] * self.num_slots
        self.slot_last_use = [0] * self.num_slots
        self.unloading: set[str] = set()  # names whose unload waits for their requests (new ones are refused)
        self._uids = itertools.count(1)
        self._clock = itertools.count(1)
        for name, path in lora_config.paths.items():
            self.add(name, path)

    def warm_up(self, max_tokens: int) -> None:
        """Run the backend's :meth:`~treadle.core.lora.backend.LoRABackend.warm_up` over every layer's stacked
        adapters for batches of 1 to ``max_tokens`` tokens (the worker's largest step), so that kernels compiled
        at first use compile now rather than on a request; one log line with its time where it ran anything."""
        warm_up = getattr(self.backend, "warm_up", None)  # a backend written before the hook: nothing to do
        if warm_up is None:
            return
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                batches = warm_up([layer.weights for layer in self.layers], max_tokens)
                if batches and self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
        except torch.OutOfMemoryError:  # its scratch tensors did not fit beside the KV pool: serve without it
            logger.warning("LoRA kernel warm-up ran out of device memory (batches of up to %d tokens); kernels it did "
                           "not reach compile at their first use", max_tokens)
            torch.cuda.empty_cache()
            return
        if batches:
            logger.info("LoRA kernels warmed up (%s backend, batches of 1 to %d tokens): %d batches in %.1f s",
                        self.backend_name, max_tokens, batches, time.perf_counter() - start)

    # ------------------------------------------------------------------ known adapters

    def add(self, name: str, path: str | Path) -> KnownAdapter:
        """Make ``name`` servable from ``path`` (read and checked now: a bad folder raises LoRAAdapterError)."""
        if not name or ":" in name:
            raise LoRAAdapterError(f"LoRA adapter name {name!r} must be non-empty and without ':'")
        if name in self.known:
            raise LoRAAdapterError(f"a LoRA adapter named {name!r} is already loaded (from "
                                   f"{self.known[name].path}); unload it first")
        adapter = load_adapter(name, path, self.max_rank, self.shapes, self.dtype)
        known = KnownAdapter(name, str(path), next(self._uids), adapter.rank)
        self.known[name] = known
        self._keep_loaded(adapter)
        logger.info("LoRA adapter %s loaded from %s (rank %d, %d projections)", name, path, adapter.rank,
                    len(adapter.modules))
        return known

    def remove(self, name: str) -> None:
        """Forget ``name``; refused (LoRAAdapterError) while requests use it: wait for them first (:meth:`in_use`)."""
        self.lookup(name)
        if self.in_use(name):
            raise LoRAAdapterError(f"LoRA adapter {name!r} is in use by running requests")
        del self.known[name]
        self.unloading.discard(name)
        self.loaded.pop(name, None)
        for slot, held in enumerate(self.slot_names):
            if held == name:
                self.slot_names[slot] = None

    def lookup(self, name: str) -> KnownAdapter:
        """The known adapter ``name``; LoRAAdapterError listing the known ones otherwise."""
        known = self.known.get(name)
        if known is None:
            names = ", ".join(sorted(self.known)) or "none"
            raise LoRAAdapterError(f"unknown LoRA adapter {name!r}; loaded adapters: {names}")
        return known

    def in_use(self, name: str) -> bool:
        """Whether requests hold a slot with ``name``."""
        return any(held == name and users for held, users in zip(self.slot_names, self.slot_users))

    def names(self) -> list[str]:
        return sorted(self.known)

    def describe(self) -> list[dict[str, Any]]:
        """Each known adapter: name, path, rank (for ``/v1/models``)."""
        return [{"name": k.name, "path": k.path, "rank": k.rank} for k in sorted(self.known.values(),
                                                                                key=lambda k: k.name)]

    # ------------------------------------------------------------------ slots

    def acquire(self, name: str | None) -> int | None:
        """A device slot holding ``name`` for one more request (None: base model; NO_ADAPTER returned), or None when
        every slot is held by other adapters' requests (the request waits)."""
        if name is None:
            return NO_ADAPTER
        slot = self._slot_of(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self._load_slot(slot, name)
        self.slot_users[slot] += 1
        self.slot_last_use[slot] = next(self._clock)
        return slot

    def release(self, slot: int) -> None:
        """Give back one request's hold on ``slot`` (NO_ADAPTER: nothing)."""
        if slot != NO_ADAPTER:
            if self.slot_users[slot] <= 0:
                raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
            self.slot_users[slot] -= 1

    def has_slot_for(self, name: str | None) -> bool:
        """Whether :meth:`acquire` would succeed now."""
        return name is None or self._slot_of(name) is not None or self._free_slot() is not None

    def _slot_of(self, name: str) -> int | None:
        for slot, held in enumerate(self.slot_names):
            if held == name:
                return slot
        return None

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one no request holds."""
        free = [slot for slot in range(self.num_slots) if self.slot_users[slot] == 0]
        if not free:
            return None
        empty = [slot for slot in free if self.slot_names[slot] is None]
        return empty[0] if empty else min(free, key=lambda slot: self.slot_last_use[slot])

    def _load_slot(self, slot: int, name: str) -> None:
        adapter = self._host_copy(name)
        # Queued on the device after every step already launched, which may still read the slot's old adapter.
        for projection in self.projections.values():
            projection.load(slot, adapter)
        self.slot_names[slot] = name

    # ------------------------------------------------------------------ host memory

    def _host_copy(self, name: str) -> LoRAAdapter:
        adapter = self.loaded.get(name)
        if adapter is not None:
            self.loaded.move_to_end(name)
            return adapter
        known = self.lookup(name)
        adapter = load_adapter(name, known.path, self.max_rank, self.shapes, self.dtype)
        self._keep_loaded(adapter)
        return adapter

    def _keep_loaded(self, adapter: LoRAAdapter) -> None:
        self.loaded[adapter.name] = adapter
        self.loaded.move_to_end(adapter.name)
        if self.max_loaded is None:
            return
        for name in list(self.loaded):
            if len(self.loaded) <= self.max_loaded:
                break
            if name != adapter.name and not self.in_use(name):
                del self.loaded[name]
                logger.info("LoRA adapter %s evicted from host memory (lora.max_loaded_loras=%d)", name,
                            self.max_loaded)


def resolve_max_rank(lora_config: Any) -> int:
    """``lora.max_rank``, or for ``auto`` the largest rank among ``lora.paths`` (16 without any)."""
    if lora_config.max_rank != "auto":
        return int(lora_config.max_rank)
    ranks = []
    for path in lora_config.paths.values():
        try:
            ranks.append(read_adapter_rank(path))
        except LoRAAdapterError:
            continue  # reported with its folder when the adapter is loaded
    return max(ranks, default=DEFAULT_MAX_RANK)


def choose_backend(name: str, registry: Any, device: torch.device) -> str:
    """``lora.backend``, or for ``auto`` ``triton`` on CUDA where a plugin registered it, else ``torch``."""
    if name != "auto":
        return name
    if device.type == "cuda" and "triton" in registry.names("lora_backends"):
        return "triton"
    return "torch"
