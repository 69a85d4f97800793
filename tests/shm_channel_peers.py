"""The other ends of the shared-memory channel, run as real processes by test_shm_channel.py (imported by name in
spawned processes, so no test module is imported there)."""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

from treadle.core.distributed.shm_channel import ShmChannelReader, ShmChannelWriter


def message(index: int, sizes: list[int]) -> bytes:
    """Message ``index`` of a test stream: deterministic bytes of the ``sizes`` cycle's length."""
    return random.Random(index).randbytes(sizes[index % len(sizes)])


def digest(messages: list[bytes]) -> str:
    hasher = hashlib.sha256()
    for payload in messages:
        hasher.update(len(payload).to_bytes(8, "little"))
        hasher.update(payload)
    return hasher.hexdigest()


def read_all(name: str, reader: int, count: int, results: Any) -> None:
    """Receive ``count`` messages and report their digest."""
    channel = ShmChannelReader(name, reader)
    try:
        received = [channel.receive(timeout_s=60) for _ in range(count)]
        results.put((reader, digest(received)))
    finally:
        channel.close()


def attach_and_leave(name: str) -> None:
    """A reader that attaches and exits without reading anything."""
    ShmChannelReader(name, 0).close()


def write_one_then_hang(names: Any) -> None:
    """A writer that sends one message, hands out its channel's name, and waits to be killed."""
    channel = ShmChannelWriter.create(num_readers=1)
    channel.send(b"hello")
    names.put(channel.name)
    time.sleep(600)
