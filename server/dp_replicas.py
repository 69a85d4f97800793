"""The data-parallel replica processes of one node: their addresses, start, watch and stop.

Node 0's controller (:mod:`treadle.server.dp_controller`) runs its node's replicas through :class:`Replicas`;
another node's agent (:mod:`treadle.server.dp_nodes`) runs that node's. Replicas are numbered across all
nodes; on CUDA the ``j``-th replica of a node sees its GPUs ``j·tp … j·tp+tp-1``.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from treadle.core.config import ParallelConfig, ServerConfig
from treadle.server.ipc import IpcAddresses

logger = logging.getLogger("treadle.dp_controller")

_REPLICA_STOP_TIMEOUT_S = 10.0


def replica_addresses(addresses: IpcAddresses, replica: int) -> IpcAddresses:
    """Replica ``replica`` receives on its own address and answers the controller, not the tokenizer manager."""
    folder = addresses.folder
    return dataclasses.replace(
        addresses,
        scheduler_input=f"ipc://{os.path.join(folder, f'scheduler-replica{replica}')}",
        tokenizer_input=controller_replies_address(addresses),
        extra_worker_inputs=(),
    )


def controller_replies_address(addresses: IpcAddresses) -> str:
    return f"ipc://{os.path.join(addresses.folder, 'dp-controller-replies')}"


def replica_config(config: ServerConfig) -> ServerConfig:
    """One replica's config: a single-node server of one replica (its tensor-parallel group, if any, on this
    node with a private rendezvous)."""
    single = config.model_copy(deep=True)
    single.parallel = ParallelConfig(**{
        **config.parallel.model_dump(), "dp_size": 1, "nnodes": 1, "node_rank": 0, "dist_init_addr": None,
        "dp_replicas_per_node": None})
    return single


class Replicas:
    """This node's replica processes (global numbers ``indices``): start, watch, stop."""

    def __init__(self, config: ServerConfig, addresses: IpcAddresses, indices: range | None = None) -> None:
        self.config = config
        self.addresses = addresses
        self.indices = indices if indices is not None else range(config.parallel.dp_size)
        self.context = mp.get_context("spawn")
        self.processes: list[Any] = []
        self._pipes: list[Connection] = []  # each launched replica's "ready" pipe
        self.dead: str | None = None

    def start(self, while_waiting: Callable[[], None] | None = None) -> tuple[dict[str, Any], Any]:
        """Start them and wait until each has loaded the model (calling ``while_waiting`` meanwhile, if given);
        returns the first one's model info and tokenizer."""
        self.launch()
        return self.wait_ready(while_waiting)

    def launch(self) -> None:
        """Start the processes (they load the model in the background)."""
        from treadle.server.scheduler_process import run_replica_process

        config = replica_config(self.config)
        for local, replica in enumerate(self.indices):
            receive, send = self.context.Pipe(duplex=False)
            process = self.context.Process(
                target=run_replica_process, name=f"scheduler-dp{replica}",
                args=(config, replica_addresses(self.addresses, replica), send),
                kwargs={"report_finished": True},
            )
            with _visible_devices(self.config, local):
                process.start()
            send.close()
            self.processes.append(process)
            self._pipes.append(receive)

    def wait_ready(self, while_waiting: Callable[[], None] | None = None) -> tuple[dict[str, Any], Any]:
        """Wait until every launched replica has loaded the model; the first one's model info and tokenizer."""
        infos = [self._wait_ready(local, pipe, while_waiting) for local, pipe in enumerate(self._pipes)]
        return infos[0]

    def _wait_ready(self, local: int, pipe: Connection,
                    while_waiting: Callable[[], None] | None) -> tuple[dict[str, Any], Any]:
        process, replica = self.processes[local], self.indices[local]
        while not pipe.poll(0 if while_waiting else 0.2):
            if while_waiting is not None:
                while_waiting()
            if not process.is_alive():
                raise RuntimeError(f"data-parallel replica {replica} exited during startup "
                                   f"(exit code {process.exitcode}); see its log above")
        try:
            message = pipe.recv()
        except EOFError:
            raise RuntimeError(f"data-parallel replica {replica} exited during startup") from None
        if message[0] != "ready":
            raise RuntimeError(f"data-parallel replica {replica} failed to start: {message[1]}")
        return message[1], message[2]

    def check_alive(self) -> bool:
        """False (and ``dead`` set) once any replica has exited."""
        ready = wait([p.sentinel for p in self.processes], timeout=0)
        if ready:
            local = next(i for i, p in enumerate(self.processes) if p.sentinel in ready)
            process = self.processes[local]
            process.join(timeout=1)
            self.dead = (f"data-parallel replica {self.indices[local]} (pid {process.pid}) exited unexpectedly "
                         f"(exit code {process.exitcode}); shutting the server down")
            logger.error(self.dead)
            return False
        return True

    def stop(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + _REPLICA_STOP_TIMEOUT_S
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


class _visible_devices:
    """Around a replica's start on CUDA: show it only its ``tp_size`` GPUs (the replica sees them as 0..tp-1)."""

    def __init__(self, config: ServerConfig, local: int) -> None:
        self.active = config.model.device != "cpu" and _cuda_device_count() > 0
        tp = config.parallel.tp_size
        if self.active:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            devices = visible.split(",") if visible else [str(i) for i in range(_cuda_device_count())]
            self.devices = ",".join(devices[local * tp:(local + 1) * tp])

    def __enter__(self) -> None:
        if self.active:
            self.saved = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = self.devices

    def __exit__(self, *exc: object) -> None:
        if self.active:
            if self.saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = self.saved


def _cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0
