"""Keeping Python's cyclic garbage collector off a long-running loop: start-up objects frozen, young ones
collected rarely."""

from __future__ import annotations

import atexit
import gc

# Net container allocations between young-generation collections (Python's default is 700). A scheduler step
# at 512 running requests makes and drops a few thousand objects (batch entries, tensors, outputs), so at 700
# nearly every step collected, and survivors were promoted until a full collection walked every request and
# cached prefix: 1,494 collections for 291 ms (pauses up to 21 ms) in a 720-step offline batch on the CPU test
# model, 2 for 13 ms at 10,000; an H100 run showed pauses up to 35 ms (docs/scheduling.md "Host time per step").
YOUNG_COLLECTION_THRESHOLD = 10_000

_unfreeze_registered = False
_default_threshold: tuple[int, ...] | None = None


def freeze_startup_objects() -> None:
    """Exempt every object alive now (modules, model, tokenizer, captured graphs) from cyclic garbage collection,
    and collect young objects every ``YOUNG_COLLECTION_THRESHOLD`` allocations instead of every 700.

    Called once a process's long-lived state is built (a scheduler, the HTTP server). Python's full
    collections walk every tracked object: after importing torch and transformers that is ~380k objects,
    ~190 ms on a 2-core CPU, and one ran every few hundred steps of a busy scheduler, stalling its loop (and
    the GPU behind it). Objects made later (requests, outputs) are collected as before, only less often.
    :func:`release_startup_objects` undoes both: Engine.shutdown and interpreter exit call it, so an engine
    that is dropped can still be collected and the process gets its own collector settings back.
    """
    global _unfreeze_registered, _default_threshold
    gc.collect()  # garbage alive now would otherwise stay uncollectable
    gc.freeze()
    if _default_threshold is None:
        _default_threshold = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *_default_threshold[1:])
    if not _unfreeze_registered:
        atexit.register(release_startup_objects)
        _unfreeze_registered = True


def release_startup_objects() -> None:
    """Give frozen objects back to the collector and restore the collector's thresholds as they were."""
    global _default_threshold
    gc.unfreeze()
    if _default_threshold is not None:
        gc.set_threshold(*_default_threshold)
        _default_threshold = None
