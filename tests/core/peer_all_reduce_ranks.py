"""The peer all-reduce run by real rank processes on the CPU (imported by name in spawned ranks, see
test_custom_all_reduce.py): each rank maps every rank's buffer from a shared file, so pushes land in the peer's
memory as over NVLink, and its kernels run under Triton's interpreter (TRITON_INTERPRET=1, inherited from the
test) concurrently with the other rank's, through ``tp_all_reduce`` as a model layer calls it.

No triton import at module level: the spawned ranks must decorate the kernels with the interpreter on.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from treadle.core.distributed.custom_all_reduce import AllReducePlan, CustomAllReduce, PeerBufferLayout

# One-shot up to 256 bytes, two-shot up to 1 KiB, the group's own all-reduce (gloo) above.
PLAN = AllReducePlan(world_size=2, one_shot_max_bytes=256, max_bytes=1024)
# (dtype, elements): sizes around both limits, odd lengths, each twice so that both halves of the buffer are
# reused; float32 and float16 interleaved.
CALLS = [(torch.float32, 5), (torch.float32, 64), (torch.float32, 65), (torch.float16, 37), (torch.float32, 256),
         (torch.float32, 257), (torch.float16, 600), (torch.float16, 129), (torch.float32, 3)] * 2


# (dtype, rows, cols) of all-reduces fused with the residual add and RMSNorm (one-shot sizes).
FUSED = [(torch.float32, 1, 48), (torch.float16, 2, 64), (torch.float32, 3, 20)]


class SmallPeerAllReduce(CustomAllReduce):
    PROGRAMS = 4
    BLOCK = 16
    MAX_SPINS = 2_000_000


def buffer_bytes(world_size: int) -> int:
    return PeerBufferLayout(world_size, SmallPeerAllReduce.PROGRAMS, PLAN.max_bytes).total_bytes


def interpreted_rank(rank: int, world_size: int, init_method: str, folder: str) -> dict[str, Any]:
    from treadle.core.distributed.parallel import (destroy_tensor_parallel, init_tensor_parallel,
                                                   install_custom_all_reduce, tp_all_reduce)

    init_tensor_parallel(rank, world_size, init_method, torch.device("cpu"), timeout_s=120.0)
    try:
        maps = [torch.from_file(os.path.join(folder, f"rank{r}.buf"), shared=True, size=buffer_bytes(world_size),
                                dtype=torch.uint8) for r in range(world_size)]
        fast = SmallPeerAllReduce(rank, world_size, maps[rank], [m.data_ptr() for m in maps], PLAN, keepalive=maps)
        dist.barrier()  # every buffer zeroed before anyone pushes
        install_custom_all_reduce(fast)
        gen = torch.Generator().manual_seed(100 + rank)
        exact = identical = True
        custom_calls = 0
        for dtype, n in CALLS:
            x = torch.randn(n, generator=gen).to(dtype)
            inputs = [torch.empty_like(x) for _ in range(world_size)]
            dist.all_gather(inputs, x)
            want = torch.stack([t.float() for t in inputs]).sum(0).to(dtype)  # rank order, float32
            custom_calls += fast.handles(x)
            got = tp_all_reduce(x.clone())
            exact &= torch.equal(got, want)
            outs = [torch.empty_like(got) for _ in range(world_size)]
            dist.all_gather(outs, got)
            identical &= all(torch.equal(o, outs[0]) for o in outs)
        fused = _fused_calls(gen, world_size)
        return {"exact": bool(exact), "identical": bool(identical), "custom_calls": custom_calls, **fused,
                "epochs": fast.epochs.tolist(), "errors": fast.error_count()}
    finally:
        destroy_tensor_parallel()


def _fused_calls(gen: torch.Generator, world_size: int) -> dict[str, Any]:
    from treadle.core.distributed.parallel import tp_all_reduce_add_rmsnorm

    sums_exact = norms_close = identical = untouched = True
    for dtype, rows, cols in FUSED:
        x = torch.randn(rows, cols, generator=gen).to(dtype)
        residual, weight = torch.randn(rows, cols).to(dtype), torch.rand(cols).to(dtype) + 0.5
        dist.broadcast(residual, 0)
        dist.broadcast(weight, 0)
        inputs = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(inputs, x)
        total = torch.stack([t.float() for t in inputs]).sum(0).to(dtype)
        want_sum = (total.float() + residual.float()).to(dtype)
        s32 = want_sum.double()
        want_norm = weight.double() * s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + 1e-5)
        before = x.clone()
        normed, summed = tp_all_reduce_add_rmsnorm(x, residual, weight, 1e-5)
        untouched &= torch.equal(x, before)
        sums_exact &= torch.equal(summed, want_sum)
        norms_close &= torch.allclose(normed.double(), want_norm, rtol=2e-3 if dtype == torch.float16 else 1e-5,
                                      atol=1e-3 if dtype == torch.float16 else 1e-5)
        outs = [torch.empty_like(normed) for _ in range(world_size)]
        dist.all_gather(outs, normed)
        identical &= all(torch.equal(o, outs[0]) for o in outs)
    return {"fused_sums_exact": bool(sums_exact), "fused_norms_close": bool(norms_close),
            "fused_identical": bool(identical), "fused_input_untouched": bool(untouched)}
