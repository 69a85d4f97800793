"""A one-writer, many-reader message channel through shared memory: rank 0's per-step commands to its node's ranks.

Rank 0 copies each message once into a ring of slots in a POSIX shared-memory segment; every other rank on the node
reads it from there. Nothing is sent over a socket and no receiver has to be woken by the kernel: a reader polls the
next slot's sequence number, spinning for a moment (a step's commands usually follow the previous step within a
fraction of a millisecond) and then sleeping in growing naps up to half a millisecond, so an idle server does not keep a
core busy.

Layout, in 8-byte words: a 64-byte header; one 64-byte line per reader (the sequence number it last read, its pid);
then ``num_slots`` slots, each a 64-byte header (sequence number, payload bytes, last-chunk flag) and ``slot_bytes``
of payload.

Protocol: chunk number ``seq`` (1, 2, ...) goes to slot ``seq % num_slots``. The writer copies the payload first and
stores the sequence number last, so a reader that sees the number sees the whole chunk (x86-64 keeps stores in
program order and never moves a load before an earlier load or a store before an earlier load; other machines make
no such promise, which is why :func:`channel_supported` says no there). The writer reuses a slot only when every
reader's line says it has read the slot's previous chunk, so nobody reads a slot that is being rewritten. A message
larger than one slot spans consecutive slots and streams through the ring as the readers keep up.

Failures: a reader waiting for a chunk checks every 0.1 s that the writer's process lives and has not closed the
channel, and raises :class:`ChannelClosed` otherwise; a writer waiting for a slot checks its readers the same way.
The writer unlinks the segment when it closes; a writer that is killed leaves it to multiprocessing's resource
tracker, which unlinks what its processes registered when they are all gone.
"""

from __future__ import annotations

import os
import platform
import secrets
import time
from multiprocessing import shared_memory
from typing import Callable

_MAGIC = 0x7472656164_6C65  # "treadle"
_LINE_WORDS = 8  # one 64-byte cache line
_MAGIC_AT, _SLOTS_AT, _SLOT_BYTES_AT, _READERS_AT, _WRITER_PID_AT, _CLOSED_AT = range(6)
_ACK, _PID = 0, 1  # a reader's line
_SEQ, _NBYTES, _LAST = 0, 1, 2  # a slot's header
_LIVENESS_EVERY_S = 0.1
_POLLS_PER_CLOCK_READ = 32

DEFAULT_SLOT_BYTES = 256 * 1024
DEFAULT_NUM_SLOTS = 8
DEFAULT_SPIN_S = 0.002
MAX_NAP_S = 0.0005


class ChannelClosed(RuntimeError):
    """The other end of the channel is gone: the writer closed it or exited, or a reader exited."""


def channel_supported() -> bool:
    """Whether this machine orders plain stores and loads as the protocol needs (x86-64's total store order)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class _Segment:
    """The mapped segment and the word offsets of its parts (shared by both ends)."""

    def __init__(self, shm: shared_memory.SharedMemory, num_slots: int, slot_bytes: int, num_readers: int) -> None:
        self.shm = shm
        self.words = shm.buf.cast("Q")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.num_readers = num_readers
        self.first_slot = _LINE_WORDS * (1 + num_readers)
        self.slot_words = _LINE_WORDS + slot_bytes // 8

    @staticmethod
    def size(num_slots: int, slot_bytes: int, num_readers: int) -> int:
        return 64 * (1 + num_readers) + num_slots * (64 + slot_bytes)

    def reader_line(self, reader: int) -> int:
        return _LINE_WORDS * (1 + reader)

    def slot(self, seq: int) -> int:
        """Word offset of the header of the slot that holds chunk ``seq``."""
        return self.first_slot + (seq % self.num_slots) * self.slot_words

    def payload(self, slot: int, nbytes: int) -> slice:
        start = (slot + _LINE_WORDS) * 8
        return slice(start, start + nbytes)

    def release(self) -> None:
        self.words.release()  # before close(): a live view of the buffer makes it fail
        self.shm.close()


class ShmChannelWriter:
    """Rank 0's end: :meth:`create` a segment for ``num_readers`` readers, pass :attr:`name` to them, :meth:`send`."""

    def __init__(self, segment: _Segment, spin_s: float = DEFAULT_SPIN_S) -> None:
        self._segment = segment
        self._spin_s = spin_s
        self._next_seq = 1
        self._acked_by_all = 0
        self._closed = False

    @classmethod
    def create(cls, num_readers: int, slot_bytes: int = DEFAULT_SLOT_BYTES, num_slots: int = DEFAULT_NUM_SLOTS,
               spin_s: float = DEFAULT_SPIN_S) -> "ShmChannelWriter":
        if num_readers < 1 or num_slots < 2 or slot_bytes < 64 or slot_bytes % 64:
            raise ValueError(f"a channel needs >= 1 reader, >= 2 slots and slots of a multiple of 64 bytes; got "
                             f"{num_readers} readers, {num_slots} slots of {slot_bytes} bytes")
        name = f"treadle-steps-{os.getpid()}-{secrets.token_hex(4)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=_Segment.size(num_slots, slot_bytes, num_readers))
        segment = _Segment(shm, num_slots, slot_bytes, num_readers)
        words = segment.words
        words[_SLOTS_AT], words[_SLOT_BYTES_AT], words[_READERS_AT] = num_slots, slot_bytes, num_readers
        words[_WRITER_PID_AT] = os.getpid()
        words[_MAGIC_AT] = _MAGIC
        return cls(segment, spin_s)

    @property
    def name(self) -> str:
        """The segment's name, which a reader attaches by."""
        return self._segment.shm.name

    def send(self, payload: bytes, check: Callable[[], None] | None = None) -> None:
        """Publish ``payload`` to every reader, in order after the previous ones. Waits only when the ring is full
        (a message larger than the free slots), calling ``check`` (which may raise) and checking the readers
        meanwhile."""
        segment, words = self._segment, self._segment.words
        view = memoryview(payload).cast("B")
        offset, total = 0, len(view)
        while True:
            seq = self._next_seq
            if seq - segment.num_slots > self._acked_by_all:
                self._wait_for_readers(seq - segment.num_slots, check)
            chunk = view[offset:offset + segment.slot_bytes]
            offset += len(chunk)
            slot = segment.slot(seq)
            segment.shm.buf[segment.payload(slot, len(chunk))] = chunk
            words[slot + _NBYTES] = len(chunk)
            words[slot + _LAST] = int(offset >= total)
            words[slot + _SEQ] = seq  # last: a reader that sees it sees the chunk
            self._next_seq = seq + 1
            if offset >= total:
                return

    def close(self) -> None:
        """Tell the readers the channel is closed and remove the segment (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._segment.words[_CLOSED_AT] = 1
        self._segment.release()
        self.unlink()

    def unlink(self) -> None:
        """Remove the segment's name (idempotent); mappings, this one included, stay valid until closed. Safe from
        another thread while this one sends: a process about to exit calls it instead of :meth:`close`."""
        try:
            self._segment.shm.unlink()
        except FileNotFoundError:
            pass

    def _acks(self) -> list[int]:
        words = self._segment.words
        return [words[self._segment.reader_line(r) + _ACK] for r in range(self._segment.num_readers)]

    def _wait_for_readers(self, seq: int, check: Callable[[], None] | None) -> None:
        def readers_alive() -> None:
            if check is not None:
                check()
            words = self._segment.words
            for reader in range(self._segment.num_readers):
                pid = words[self._segment.reader_line(reader) + _PID]
                if pid and not _process_alive(pid):
                    raise ChannelClosed(f"reader {reader} (pid {pid}) of channel {self.name} exited")

        def all_read() -> bool:
            self._acked_by_all = min(self._acks())
            return self._acked_by_all >= seq

        _wait(all_read, self._spin_s, None, readers_alive)


class ShmChannelReader:
    """A rank's end: attach to the writer's segment by name as reader ``reader`` (0 .. num_readers - 1)."""

    def __init__(self, name: str, reader: int, spin_s: float = DEFAULT_SPIN_S) -> None:
        shm = shared_memory.SharedMemory(name=name)
        words = shm.buf.cast("Q")
        try:
            if words[_MAGIC_AT] != _MAGIC:
                raise ValueError(f"shared memory {name!r} is not a treadle channel (or not ready)")
            layout = words[_SLOTS_AT], words[_SLOT_BYTES_AT], words[_READERS_AT]
        finally:
            words.release()
        if not 0 <= reader < layout[2]:
            shm.close()
            raise ValueError(f"reader {reader} is out of range: channel {name!r} has {layout[2]} readers")
        self._segment = _Segment(shm, *layout)
        self._line = self._segment.reader_line(reader)
        self._segment.words[self._line + _PID] = os.getpid()
        self._writer_pid = self._segment.words[_WRITER_PID_AT]
        self._spin_s = spin_s
        self._next_seq = self._segment.words[self._line + _ACK] + 1
        self._closed = False

    def receive(self, timeout_s: float | None = None) -> bytes:
        """The next message. Raises :class:`ChannelClosed` when the writer closed the channel or its process is gone,
        ``TimeoutError`` after ``timeout_s`` (None: wait as long as the writer lives)."""
        segment, words = self._segment, self._segment.words
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        chunks = []
        while True:
            seq = self._next_seq
            slot = segment.slot(seq)
            if words[slot + _SEQ] != seq:
                _wait(lambda: words[slot + _SEQ] == seq, self._spin_s, deadline, self._check_writer)
            chunks.append(bytes(segment.shm.buf[segment.payload(slot, words[slot + _NBYTES])]))
            last = words[slot + _LAST]
            words[self._line + _ACK] = seq  # after the copy: the writer may reuse the slot from now on
            self._next_seq = seq + 1
            if last:
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def close(self) -> None:
        """Unmap the segment (the writer removes it)."""
        if not self._closed:
            self._closed = True
            self._segment.release()

    def _check_writer(self) -> None:
        if self._segment.words[_CLOSED_AT]:
            raise ChannelClosed(f"the writer closed channel {self._segment.shm.name}")
        if not _process_alive(self._writer_pid):
            raise ChannelClosed(f"the writer of channel {self._segment.shm.name} (pid {self._writer_pid}) exited")


def _wait(ready: Callable[[], bool], spin_s: float, deadline: float | None, check: Callable[[], None]) -> None:
    """Return once ``ready()``: spin for ``spin_s``, then nap (doubling up to ``MAX_NAP_S``); ``check()`` every
    ``_LIVENESS_EVERY_S`` may raise; past ``deadline`` (monotonic) raise ``TimeoutError``."""
    now = time.monotonic()
    spin_until, next_check, nap = now + spin_s, now + _LIVENESS_EVERY_S, 20e-6
    while True:
        for _ in range(_POLLS_PER_CLOCK_READ):
            if ready():
                return
        now = time.monotonic()
        if now >= next_check:
            check()
            next_check = now + _LIVENESS_EVERY_S
        if deadline is not None and now >= deadline:
            raise TimeoutError("no message on the shared-memory channel before the timeout")
        if now >= spin_until:
            time.sleep(nap)
            nap = min(2 * nap, MAX_NAP_S)


def _process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc here: the signal check is all there is
    return state not in (b"Z", b"X")
