"""Keeping Python's cyclic garbage collector off a long-running loop's objects loaded at start-up."""

from __future__ import annotations

import atexit
import gc

_unfreeze_registered = False


def freeze_startup_objects() -> None:
    """Exempt every object alive now (modules, model, tokenizer, captured graphs) from cyclic garbage collection.

    Called once a process's long-lived state is built (a scheduler, the HTTP server). Python's full
    collections walk every tracked object: after importing torch and transformers that is ~380k objects,
    ~190 ms on a 2-core CPU, and one ran every few hundred steps of a busy scheduler, stalling its loop (and
    the GPU behind it). Objects made later (requests, outputs) are collected as before. ``gc.unfreeze()``
    gives the frozen ones back: Engine.shutdown and interpreter exit call it, so an engine that is dropped
    can still be collected.
    """
    global _unfreeze_registered
    gc.collect()  # garbage alive now would otherwise stay uncollectable
    gc.freeze()
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True
