"""Smoke check on one GPU: torch.distributed NCCL collectives (all-reduce, all-gather) replay inside a CUDA graph.

A one-rank NCCL group goes through the same ProcessGroupNCCL capture path as tp=2 does; run it where no
multi-GPU machine is at hand: ``python3 tests/gpu/nccl_graph_smoke.py``.
"""

from __future__ import annotations

import tempfile

import torch
import torch.distributed as dist

from treadle.core.distributed.parallel import _all_gather_single


def main() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = tempfile.mktemp(prefix="nccl-smoke-")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1, device_id=device)
    x = torch.arange(8, dtype=torch.float32, device=device)
    gathered = torch.empty(8, dtype=torch.float32, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as CudaGraphRunner does
        for _ in range(2):
            y = x * 2
            dist.all_reduce(y)
            _all_gather_single(gathered, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
        dist.all_reduce(y)
        _all_gather_single(gathered, y)
    x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gathered, (torch.arange(8, device=device) + 1) * 2.0), gathered
    print("NCCL all-reduce + all-gather captured in a CUDA graph and replayed: OK", torch.__version__,
          torch.cuda.nccl.version())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
