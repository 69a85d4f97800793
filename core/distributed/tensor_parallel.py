"""One scheduler per tensor-parallel rank: rank 0 leads, the others replay its decisions.

Every rank holds its share of the model and of the KV cache and runs the same
deterministic :class:`~treadle.core.scheduling.scheduler.Scheduler`. Only rank 0 talks to
the outside (Engine caller, scheduler process sockets). It records what
changes scheduler state — new requests, aborts, cache flushes, steps — and
broadcasts the list before each step (pickled once; through a shared-memory channel,
``shm_channel.py``, when every rank is on this node, else over gloo), so every rank admits,
batches, retracts and samples identically: the same ForwardBatch on every rank,
the same logits after the all-gather, the same tokens.

:func:`start_scheduler` is the one entry point: at ``tp_size`` 1 it is a plain
``Scheduler``; otherwise it starts this node's other ranks as processes, joins the
group as rank 0 and returns a :class:`LeaderScheduler`. A node other than node 0
runs :func:`run_node_ranks` instead (no HTTP, no requests). A rank that dies is
noticed by a watcher thread (local ranks) or by the next collective failing
(remote ranks); either way the log names it and the group goes down. Before the
group forms, rank 0 waits for the ranks to check in and fails at once when a local
one has died; a remote one that never checks in fails it after ``dist_timeout_s``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Iterator

from treadle.core.config import ServerConfig
from treadle.core.distributed.custom_all_reduce import setup_custom_all_reduce
from treadle.core.distributed.parallel import (
    destroy_tensor_parallel,
    get_tp_group,
    init_tensor_parallel,
    tp_broadcast_object,
    tp_gather_objects,
)
from treadle.core.distributed.rank_layout import RankLayout, TensorParallelError
from treadle.core.distributed.shm_channel import ShmChannelReader, ShmChannelWriter, channel_supported

logger = logging.getLogger(__name__)

_STEP, _ADD, _ABORT, _FLUSH, _STATS, _STOP = "step", "add", "abort", "flush", "stats", "stop"
_LORA_LOAD, _LORA_UNLOAD = "lora_load", "lora_unload"
_LOG_FORMAT = "[treadle %(processName)s] %(asctime)s %(levelname)s %(name)s: %(message)s"
_PR_SET_PDEATHSIG = 1


class LeaderGone(RuntimeError):
    """Rank 0 went away while this rank waited for its next step: the group is over.

    A server's processes end without goodbyes on SIGTERM, so from another node a stopped
    server and a failed one look alike; node 0's own log says which it was.
    """


def start_scheduler(config: ServerConfig, registry: Any = None, in_server: bool = False, offline: bool = False) -> Any:
    """The scheduler of one replica: a ``Scheduler`` at tp 1, else rank 0's :class:`LeaderScheduler`
    with this node's other ranks started as processes.

    ``in_server``: a rank that dies ends this process (the server notices and shuts down);
    otherwise (the offline Engine) the failure surfaces as an exception in the caller. ``offline``: the
    ``auto`` sizes are resolved for an offline batch (on every rank alike).
    """
    from treadle.core.loading.gc_freeze import freeze_startup_objects
    from treadle.core.scheduling.scheduler import Scheduler

    if config.parallel.tp_size == 1:
        scheduler = Scheduler(config, registry, offline=offline)
        freeze_startup_objects()
        return scheduler
    if config.parallel.node_rank != 0:
        raise TensorParallelError("only node 0 (parallel.node_rank 0) runs rank 0; other nodes use run_node_ranks")
    layout = RankLayout.of(config)
    check_model_splits(config)
    init_method = layout.init_method()
    channel = open_step_channel(config, layout)
    ranks = RankProcesses(config, layout, init_method, first_local=1, offline=offline,
                          step_channel=channel.name if channel is not None else None)
    try:
        ranks.start()
        watcher = ranks.watch(exit_process=in_server, before_exit=channel.unlink if channel is not None else None)
        _join_group(layout, 0, init_method, config, check_peers=ranks.check_alive)
        scheduler = Scheduler(config, registry, offline=offline)
    except BaseException:
        ranks.stop()
        destroy_tensor_parallel()
        remove_file_store(init_method)
        if channel is not None:
            channel.close()
        raise
    freeze_startup_objects()
    leader = LeaderScheduler(scheduler, ranks, watcher, channel)
    # A script that ends without Engine.shutdown() still stops its ranks with a goodbye, before multiprocessing's
    # own exit hook would terminate them (hooks run last-registered first).
    atexit.register(leader.shutdown)
    return leader


def remove_file_store(init_method: str) -> None:
    """Delete a ``file://`` group's store once the group is gone. Torch deletes it when the last rank lets go,
    which a rank that died (or never joined) does not do."""
    if init_method.startswith("file://"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(init_method[len("file://"):])


def open_step_channel(config: ServerConfig, layout: RankLayout) -> ShmChannelWriter | None:
    """The shared-memory channel for rank 0's per-step commands (``shm_channel.py``), or None for gloo: when
    ``parallel.step_broadcast`` says gloo, the group spans nodes, or this machine's memory order does not suit it."""
    if config.parallel.step_broadcast == "gloo" or layout.nnodes > 1 or not channel_supported():
        return None
    try:
        return ShmChannelWriter.create(num_readers=layout.tp_size - 1)
    except OSError as exc:  # no (or a full) /dev/shm: the commands still reach the ranks over gloo
        logger.warning("tensor-parallel step commands go over gloo: no shared-memory channel (%s)", exc)
        return None


def run_node_ranks(config: ServerConfig) -> int:
    """A node other than node 0: run its ``tp_size / nnodes`` ranks until rank 0 stops them.

    Returns the exit status: 0 when rank 0 stopped the group, 1 when a rank failed.
    """
    layout = RankLayout.of(config)
    ranks = RankProcesses(config, layout, layout.init_method(), first_local=0)
    ranks.start()
    logger.info("node %d runs tensor-parallel ranks %s; rank 0 is at %s",
                layout.node_rank, list(layout.local_ranks()), config.parallel.dist_init_addr)
    try:
        return ranks.wait_all()
    finally:
        ranks.stop()


def check_model_splits(config: ServerConfig) -> None:
    """Raise :class:`TensorParallelError` unless the model's heads split evenly over ``tp_size`` ranks
    (checked before any rank starts)."""
    from treadle.core.loading.model_loader import read_hf_config, resolve_model_path
    from treadle.core.distributed.parallel import tp_head_counts

    hf = read_hf_config(resolve_model_path(config.model))
    heads = hf.num_attention_heads
    try:
        tp_head_counts(heads, getattr(hf, "num_key_value_heads", None) or heads, config.parallel.tp_size)
    except ValueError as exc:
        raise TensorParallelError(str(exc)) from None


class LeaderScheduler:
    """Rank 0's scheduler: the ``Scheduler`` API, with every state change broadcast to the other ranks.

    Additions and aborts are queued and sent with the next step or flush, in order,
    so a step costs one broadcast. Reads (``kv_stats``, ``model_info``, ``tokenizer``, ...)
    go straight to the local scheduler.
    """

    def __init__(self, scheduler: Any, ranks: "RankProcesses", watcher: threading.Thread | None,
                 channel: ShmChannelWriter | None = None) -> None:
        self.scheduler = scheduler
        self.ranks = ranks
        self.watcher = watcher
        self.channel = channel  # the step commands' shared-memory channel; None: gloo
        self._commands: list[tuple[Any, ...]] = []
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)

    @property
    def local_scheduler(self) -> Any:
        """Rank 0's own ``Scheduler``, which this wrapper drives: patch its attributes (a meter's hooks) there, since
        attributes set on the wrapper do not reach it."""
        return self.scheduler

    @property
    def model_info(self) -> dict[str, Any]:
        fast = get_tp_group().custom_all_reduce
        return {**self.scheduler.model_info, "tp_size": self.ranks.layout.tp_size,
                "tp_rank_pids": {rank: process.pid for rank, process in self.ranks.processes.items()},
                "all_reduce": fast.describe() if fast is not None else "nccl",
                "step_broadcast": "gloo" if self.channel is None else "shared_memory",
                "step_channel": None if self.channel is None else self.channel.name}

    def add_request(self, req: Any) -> None:
        snapshot = pickle.dumps(req)  # before the local scheduler touches it
        self.scheduler.add_request(req)
        self._commands.append((_ADD, snapshot))

    def abort_request(self, rid: str) -> Any:
        self._commands.append((_ABORT, rid))
        return self.scheduler.abort_request(rid)

    def step(self) -> list[Any]:
        self._broadcast((_STEP,))
        with self.ranks.naming_a_dead_rank():  # the forward's all-reduces fail too when a rank dies
            return self.scheduler.step()

    def flush_cache(self) -> bool:
        self._broadcast((_FLUSH,))
        return self.scheduler.flush_cache()

    def load_lora_adapter(self, name: str, path: str) -> None:
        self.scheduler.load_lora_adapter(name, path)  # raises on a bad folder: then no rank loads it
        self._commands.append((_LORA_LOAD, name, path))

    def unload_lora_adapter(self, name: str) -> bool:
        if not self.scheduler.unload_lora_adapter(name):
            return False
        self._commands.append((_LORA_UNLOAD, name))
        return True

    def kv_stats_per_rank(self) -> list[dict[str, int]]:
        """``kv_stats()`` of every rank, in rank order (they agree unless the ranks diverged)."""
        self._broadcast((_STATS,))
        return tp_gather_objects(self.scheduler.kv_stats())

    def shutdown(self) -> None:
        """Stop the other ranks and leave the group."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        self.ranks.stopping = True
        try:
            self._broadcast((_STOP,))
        except Exception:  # a rank already gone: nothing left to tell
            pass
        self.ranks.join_or_kill()
        if self.ranks.failed is None:  # after a failure a collective may never finish: no waiting on the GPU
            self.scheduler.worker.release_graphs()
        destroy_tensor_parallel()
        self._remove_files()

    def stop_without_goodbye(self) -> None:
        """Stop the other ranks at once and remove the group's store: for a signal that may arrive mid-step, when
        the ranks wait in a collective and cannot take a stop command."""
        self._closed = True
        self.ranks.stop()
        self._remove_files()

    def _remove_files(self) -> None:
        remove_file_store(self.ranks.init_method)
        if self.channel is not None:
            self.channel.close()

    def _broadcast(self, last: tuple[Any, ...]) -> None:
        commands, self._commands = self._commands + [last], []
        self.ranks.check_alive()
        with self.ranks.naming_a_dead_rank():  # a rank that died also closes the channel's wait
            if self.channel is None:
                tp_broadcast_object(commands)
            else:
                self.channel.send(pickle.dumps(commands, protocol=pickle.HIGHEST_PROTOCOL), self.ranks.check_alive)


def follow_leader(scheduler: Any, channel: ShmChannelReader | None = None) -> None:
    """A rank other than 0: apply rank 0's broadcast commands (from ``channel``, else over gloo) to ``scheduler``
    until told to stop."""
    from treadle.core.request import InvalidRequestError

    while True:
        try:
            commands = tp_broadcast_object(None) if channel is None else pickle.loads(channel.receive())
        except RuntimeError as exc:  # a closed connection: rank 0's process ended (stopped or failed)
            raise LeaderGone(str(exc).splitlines()[0]) from None
        for command in commands:
            kind = command[0]
            if kind == _STEP:
                scheduler.step()
            elif kind == _ADD:
                try:
                    scheduler.add_request(pickle.loads(command[1]))
                except InvalidRequestError:
                    pass  # rank 0 refused it too, before sending; kept for symmetry
            elif kind == _ABORT:
                scheduler.abort_request(command[1])
            elif kind == _FLUSH:
                scheduler.flush_cache()
            elif kind == _LORA_LOAD:
                scheduler.load_lora_adapter(command[1], command[2])
            elif kind == _LORA_UNLOAD:
                scheduler.unload_lora_adapter(command[1])
            elif kind == _STATS:
                tp_gather_objects(scheduler.kv_stats())
            elif kind == _STOP:
                return


class RankProcesses:
    """This node's rank processes (``first_local`` 1 on node 0, whose rank 0 is the caller): start, watch, stop."""

    def __init__(self, config: ServerConfig, layout: RankLayout, init_method: str, first_local: int,
                 offline: bool = False, step_channel: str | None = None) -> None:
        import multiprocessing as mp

        self.config = config
        self.offline = offline
        self.layout = layout
        self.init_method = init_method
        self.step_channel = step_channel
        self.ranks = list(layout.local_ranks())[first_local:]
        self.context = mp.get_context("spawn")  # CUDA and threads do not survive fork
        self.processes: dict[int, Any] = {}
        self.stopping = False
        self.failed: str | None = None

    def start(self) -> None:
        for rank in self.ranks:
            process = self.context.Process(
                target=run_rank_process,
                args=(self.config, rank, self.init_method, self.offline, self.step_channel),
                name=f"scheduler-tp{rank}", daemon=True,
            )
            process.start()
            self.processes[rank] = process

    def watch(self, exit_process: bool, before_exit: Callable[[], None] | None = None) -> threading.Thread | None:
        """A daemon thread that logs a rank's death and (``exit_process``) ends this process at once, after
        ``before_exit`` (which must be safe beside the main thread)."""
        if not self.processes:
            return None

        def _watch() -> None:
            sentinels = {p.sentinel: rank for rank, p in self.processes.items()}
            ready = wait(list(sentinels))
            if self.stopping:
                return
            self._note_failure(sentinels[ready[0]])
            if exit_process:
                if before_exit is not None:
                    before_exit()
                os._exit(1)

        thread = threading.Thread(target=_watch, name="tp-rank-watcher", daemon=True)
        thread.start()
        return thread

    def check_alive(self) -> None:
        """Raise :class:`TensorParallelError` if a local rank has exited."""
        if self.failed:
            raise TensorParallelError(self.failed)
        for rank, process in self.processes.items():
            if not process.is_alive():
                self._note_failure(rank)
                raise TensorParallelError(self.failed or "")

    @contextlib.contextmanager
    def naming_a_dead_rank(self, grace_s: float = 5.0) -> Iterator[None]:
        """Turn a collective's transport error into :class:`TensorParallelError` naming the rank that died.

        A killed peer closes its connections before its process is reaped, so the collective can fail
        before ``check_alive`` sees the death: wait a moment for it.
        """
        try:
            yield
        except RuntimeError as exc:
            if isinstance(exc, TensorParallelError):
                raise
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                dead = [rank for rank, process in self.processes.items() if not process.is_alive()]
                if dead:
                    self._note_failure(dead[0])
                    raise TensorParallelError(self.failed or "") from exc
                time.sleep(0.05)
            raise

    def wait_all(self) -> int:
        """Block until every rank exits; 0 if all exited cleanly, else 1 (the rest are stopped)."""
        remaining = dict(self.processes)
        status = 0
        while remaining:
            ready = wait([p.sentinel for p in remaining.values()])
            for rank in [r for r, p in remaining.items() if p.sentinel in ready]:
                process = remaining.pop(rank)
                process.join()
                if process.exitcode != 0 and status == 0:
                    self._note_failure(rank)
                    status = 1
                    self.stop()
        return status

    def join_or_kill(self, timeout_s: float = 10.0) -> None:
        for process in self.processes.values():
            process.join(timeout=timeout_s)
        self.stop()

    def stop(self) -> None:
        self.stopping = True
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
        for process in self.processes.values():
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)

    def _note_failure(self, rank: int) -> None:
        process = self.processes[rank]
        process.join(timeout=1)
        self.failed = (f"tensor-parallel rank {rank} (pid {process.pid}) exited unexpectedly "
                       f"(exit code {process.exitcode}); shutting the tensor-parallel group down")
        logger.error(self.failed)


def run_rank_process(config: ServerConfig, rank: int, init_method: str, offline: bool = False,
                     step_channel: str | None = None) -> None:
    """Process entry point of a rank other than 0: join, load the model shard, follow rank 0 (its step commands
    from the shared-memory channel ``step_channel`` names, or over gloo)."""
    _configure_rank_process(config.server.log_level)
    layout = RankLayout.of(config)
    channel = None
    try:
        if step_channel is not None:  # only on rank 0's node: its ranks are 1 .. tp_size - 1
            channel = ShmChannelReader(step_channel, reader=rank - 1)
        _join_group(layout, rank, init_method, config)
        from treadle.core.loading.gc_freeze import freeze_startup_objects
        from treadle.core.scheduling.scheduler import Scheduler

        scheduler = Scheduler(config, None, offline=offline)
        freeze_startup_objects()
        follow_leader(scheduler, channel)
        scheduler.worker.release_graphs()
    except LeaderGone as exc:
        logger.warning("tensor-parallel rank %d: the group ended while waiting for rank 0 (its server stopped, "
                       "or a rank failed: see node 0's log); exiting (%s)", rank, exc)
    except Exception:
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        raise SystemExit(1)
    finally:
        if channel is not None:
            channel.close()
        destroy_tensor_parallel()


def _configure_rank_process(log_level: str) -> None:
    # Ctrl-C reaches the whole process group: only rank 0's process acts on it and then stops
    # the ranks. SIGTERM keeps its default action (a rank blocked in a collective could not run a
    # Python handler), and the kernel sends it when the parent dies.
    logging.basicConfig(level=log_level.upper(), format=_LOG_FORMAT, force=True)
    # tqdm's default lock is a named semaphore that a rank ended by SIGTERM would leak; its bars are its own.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass


def _join_group(layout: RankLayout, rank: int, init_method: str, config: ServerConfig,
                check_peers: Callable[[], None] | None = None) -> None:
    device = layout.local_device(rank)
    init_tensor_parallel(rank, layout.tp_size, init_method, device, config.parallel.dist_timeout_s, check_peers)
    local_devices = [layout.local_device(r).index for r in layout.local_ranks()]
    setup_custom_all_reduce(config.parallel.custom_all_reduce, device, layout.nnodes, local_devices)

