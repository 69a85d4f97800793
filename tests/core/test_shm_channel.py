"""The shared-memory channel that carries rank 0's step commands to its node's ranks (core/distributed/shm_channel.py):
across real processes, in order, messages larger than the ring, and the failures it must not hang on."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from multiprocessing import shared_memory

import pytest
from shm_channel_peers import attach_and_leave, digest, message, read_all, write_one_then_hang

from treadle.core.distributed.shm_channel import ChannelClosed, ShmChannelReader, ShmChannelWriter

# Empty, tiny, exactly one slot, one byte over, and larger than the whole ring (4 slots of 4 KiB).
SIZES = [0, 7, 300, 4096, 4097, 40_000, 25]


def _segment_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def test_every_reader_gets_every_message_in_order_across_processes():
    context = mp.get_context("spawn")
    writer = ShmChannelWriter.create(num_readers=2, slot_bytes=4096, num_slots=4)
    results = context.Queue()
    count = 300
    readers = [context.Process(target=read_all, args=(writer.name, r, count, results)) for r in range(2)]
    try:
        for process in readers:
            process.start()
        sent = [message(i, SIZES) for i in range(count)]
        for payload in sent:
            writer.send(payload)
        assert sorted(results.get(timeout=60) for _ in readers) == [(0, digest(sent)), (1, digest(sent))]
    finally:
        for process in readers:
            process.join(timeout=10)
        writer.close()
    assert [process.exitcode for process in readers] == [0, 0]
    assert not _segment_exists(writer.name)


def test_a_reader_waiting_on_a_dead_writer_raises_instead_of_hanging():
    context = mp.get_context("spawn")
    names = context.Queue()
    writer = context.Process(target=write_one_then_hang, args=(names,))
    writer.start()
    name = names.get(timeout=60)
    reader = ShmChannelReader(name, 0)
    try:
        assert reader.receive(timeout_s=10) == b"hello"
        os.kill(writer.pid, signal.SIGKILL)  # not reaped yet: a zombie must count as dead
        started = time.monotonic()
        with pytest.raises(ChannelClosed, match=rf"writer of channel {name} \(pid {writer.pid}\) exited"):
            reader.receive(timeout_s=30)
        assert time.monotonic() - started < 2
    finally:
        reader.close()
        writer.join(timeout=10)
        shared_memory.SharedMemory(name=name).unlink()  # what the dead writer could not do


def test_a_writer_waiting_for_a_dead_reader_raises_instead_of_hanging():
    writer = ShmChannelWriter.create(num_readers=1, slot_bytes=64, num_slots=2)
    try:
        reader = mp.get_context("spawn").Process(target=attach_and_leave, args=(writer.name,))
        reader.start()
        reader.join(timeout=60)
        writer.send(b"x" * 128)  # two slots: fits without a reader's help
        with pytest.raises(ChannelClosed, match=r"reader 0 \(pid \d+\) of channel .* exited"):
            writer.send(b"y")
    finally:
        writer.close()


def test_receive_times_out_closing_wakes_readers_and_removes_the_segment():
    writer = ShmChannelWriter.create(num_readers=1, slot_bytes=64, num_slots=2)
    reader = ShmChannelReader(writer.name, 0, spin_s=0.0)
    try:
        with pytest.raises(TimeoutError):
            reader.receive(timeout_s=0.05)
        writer.send(b"last words")
        writer.close()
        assert not _segment_exists(writer.name)
        assert reader.receive() == b"last words"  # sent before the close: still delivered
        with pytest.raises(ChannelClosed, match="closed"):
            reader.receive(timeout_s=5)
    finally:
        reader.close()
        writer.close()  # twice is fine


def test_a_writer_with_a_full_ring_calls_the_check_it_was_given():
    writer = ShmChannelWriter.create(num_readers=1, slot_bytes=64, num_slots=2)
    reader = ShmChannelReader(writer.name, 0)

    def rank_died() -> None:
        raise RuntimeError("rank 1 exited")

    try:
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            writer.send(b"z" * 200, check=rank_died)  # 4 chunks, 2 slots, nobody reading
    finally:
        reader.close()
        writer.close()


def test_a_rank_following_a_closed_channel_learns_that_the_leader_is_gone():
    from treadle.core.distributed.tensor_parallel import LeaderGone, follow_leader

    writer = ShmChannelWriter.create(num_readers=1)
    reader = ShmChannelReader(writer.name, 0)
    try:
        writer.close()
        with pytest.raises(LeaderGone, match="closed"):
            follow_leader(scheduler=None, channel=reader)
    finally:
        reader.close()


def test_the_channel_is_used_only_for_a_group_on_this_node_of_an_x86_host_unless_gloo_is_asked(monkeypatch):
    from treadle.core.config import load_config
    from treadle.core.distributed import shm_channel
    from treadle.core.distributed.rank_layout import RankLayout
    from treadle.core.distributed.tensor_parallel import open_step_channel

    def channel_for(step_broadcast: str, nnodes: int) -> str | None:
        config = load_config(overrides={"parallel.tp_size": 2, "parallel.step_broadcast": step_broadcast},
                             use_env=False)
        channel = open_step_channel(config, RankLayout(2, nnodes, 0, None, "cpu", 60.0))
        if channel is None:
            return None
        channel.close()
        return channel.name

    name = channel_for("auto", 1)
    assert name is not None and not _segment_exists(name)
    assert channel_for("gloo", 1) is None
    assert channel_for("auto", 2) is None
    monkeypatch.setattr(shm_channel.platform, "machine", lambda: "aarch64")
    assert channel_for("auto", 1) is None
