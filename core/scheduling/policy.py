"""The SchedulePolicy interface: in which order waiting requests are admitted."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from treadle.core.memory.radix_cache import PrefixCache
    from treadle.core.request import Req


class SchedulePolicy(ABC):
    """Orders the waiting queue before each admission round.

    Built by its registered factory as ``factory(seed)``. ``order`` returns a
    permutation of ``waiting`` (it must neither drop nor add requests); it may
    consult the prefix cache (``match_prefix``, the tree) but must not change it; a request's prefixes are those of
    its LoRA adapter (``tree_cache.match_prefix(req.all_ids, req.lora_uid)``; ``lora_uid`` is None for the base).
    """

    # Whether the policy needs radix-cache prefix lengths (lpm, dfs-weight).
    uses_prefix_cache: bool = False

    @abstractmethod
    def order(self, waiting: list["Req"], tree_cache: "PrefixCache") -> list["Req"]: ...
