"""Where a tensor-parallel group's ranks run: which of them this node hosts, their devices, their rendezvous."""

from __future__ import annotations

import os
import tempfile

import torch

from treadle.core.config import ServerConfig


class TensorParallelError(RuntimeError):
    """The tensor-parallel layout cannot run here, or a rank failed."""


class RankLayout:
    """Which global ranks this node hosts and how they meet: ``tp_size / nnodes`` ranks per node."""

    def __init__(self, tp_size: int, nnodes: int, node_rank: int, dist_init_addr: str | None,
                 device_type: str, timeout_s: float) -> None:
        self.tp_size = tp_size
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.dist_init_addr = dist_init_addr
        self.device_type = device_type
        self.timeout_s = timeout_s
        self.ranks_per_node = tp_size // nnodes
        self._file_store: str | None = None

    @classmethod
    def of(cls, config: ServerConfig) -> "RankLayout":
        from treadle.core.loading.model_loader import resolve_device

        par = config.parallel
        device = resolve_device(config.model.device)
        layout = cls(par.tp_size, par.nnodes, par.node_rank, par.dist_init_addr, device.type, par.dist_timeout_s)
        if device.type == "cuda":
            available = torch.cuda.device_count()
            if layout.ranks_per_node > available:
                raise TensorParallelError(
                    f"parallel.tp_size={par.tp_size} over {par.nnodes} node(s) needs {layout.ranks_per_node} GPUs on "
                    f"this node but {available} are visible; lower tp_size or raise nnodes")
        return layout

    def local_ranks(self) -> range:
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def local_device(self, rank: int) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", rank - self.node_rank * self.ranks_per_node)
        return torch.device("cpu")

    def init_method(self) -> str:
        """``tcp://dist_init_addr`` (multi-node, or when given); else a fresh file store for this group."""
        if self.dist_init_addr:
            return f"tcp://{self.dist_init_addr}"
        if self._file_store is None:
            handle, path = tempfile.mkstemp(prefix="treadle-tp-", suffix=".store")
            os.close(handle)
            os.unlink(path)  # the store creates it; a stale file would confuse the rendezvous
            self._file_store = path
        return f"file://{self._file_store}"
