"""The built-in poolings, registered like a third-party plugin's: ``last``, ``mean``, ``cls``."""

from __future__ import annotations

from treadle.core.embedding.pooling import BUILTIN_POOLINGS
from treadle.core.hookspecs import Register, hookimpl


@hookimpl
def treadle_register_poolings(register: Register) -> None:
    for name, pooling_cls in BUILTIN_POOLINGS.items():
        register(name, pooling_cls)
