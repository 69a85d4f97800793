"""Run by test_custom_all_reduce.py in a subprocess under TRITON_INTERPRET=1: the peer all-reduce kernels on the
CPU, the ranks' buffers plain tensors in one process.

The interpreter runs one launch at a time, so the ranks run one after another, rank 0 first: before rank r runs,
what the ranks after it would have pushed by then is written into its buffer by hand (with their flags), and the
ranks before it have really pushed. Prints one JSON line per scenario.

With ``--ptx`` it instead compiles the kernels for Hopper (sm_90, no GPU needed) and prints what their PTX holds:
the flags' system-scope release/acquire, 16-byte data accesses, and no multicast instruction.
"""

from __future__ import annotations

import json
import os
import sys

if "--ptx" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from treadle.core.distributed.custom_all_reduce import PeerBufferLayout  # noqa: E402
from treadle.kernels.peer_all_reduce import (  # noqa: E402
    one_shot_all_reduce_add_rmsnorm_kernel,
    one_shot_all_reduce_kernel,
    two_shot_all_reduce_kernel,
)

PROGRAMS, BLOCK, SLOT_BYTES = 4, 16, 1024


class SimulatedRanks:
    def __init__(self, world: int, dtype: torch.dtype) -> None:
        self.world, self.dtype = world, dtype
        self.layout = PeerBufferLayout(world, PROGRAMS, SLOT_BYTES)
        self.buffers = [torch.zeros(self.layout.total_bytes, dtype=torch.uint8) for _ in range(world)]
        self.bases = torch.tensor([b.data_ptr() for b in self.buffers], dtype=torch.int64)
        self.epochs = [torch.zeros(PROGRAMS, dtype=torch.int64) for _ in range(world)]
        self.errors = [torch.zeros(1, dtype=torch.int32) for _ in range(world)]

    def flags(self, rank: int) -> torch.Tensor:
        return self.buffers[rank][:self.layout.flag_bytes].view(torch.int64)[:2 * self.world * PROGRAMS].view(
            2, self.world, PROGRAMS)

    def slots(self, rank: int) -> torch.Tensor:
        return self.buffers[rank][self.layout.flag_bytes:].view(self.dtype).view(2, self.world, -1)

    def run(self, kernel, xs: list[torch.Tensor], prefill: bool = True, max_spins: int = 1000) -> list[torch.Tensor]:
        n, epoch = xs[0].numel(), int(self.epochs[0][0]) + 1
        want = _rank_order_sum(xs)
        outs = []
        for rank in range(self.world):
            if prefill:
                self._pretend_later_ranks_pushed(kernel, rank, xs, want, epoch)
            x = xs[rank].clone()
            kernel[(PROGRAMS,)](x, n, self.bases, self.epochs[rank], self.errors[rank], RANK=rank, WORLD=self.world,
                                PROGRAMS=PROGRAMS, BLOCK=BLOCK, FLAG_BYTES=self.layout.flag_bytes,
                                SLOT_ELEMS=self.layout.slot_elems(self.dtype), MAX_SPINS=max_spins)
            outs.append(x)
        return outs

    def _pretend_later_ranks_pushed(self, kernel, rank, xs, want, epoch) -> None:
        half, n = epoch % 2, xs[0].numel()
        chunk = -(-(-(-n // self.world)) // 16) * 16  # the kernel's chunks: 16-element aligned
        for later in range(rank + 1, self.world):
            slot = self.slots(rank)[half, later]
            if kernel is one_shot_all_reduce_kernel:
                slot[:n] = xs[later]
            else:
                mine = slice(rank * chunk, min((rank + 1) * chunk, n))
                theirs = slice(later * chunk, min((later + 1) * chunk, n))
                slot[mine] = xs[later][mine]
                slot[theirs] = want[theirs]
                self.flags(rank)[1, later] = epoch
            self.flags(rank)[0, later] = epoch


def _rank_order_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    acc = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:
        acc += x.float()
    return acc.to(xs[0].dtype)


def scenario(world: int, dtype: torch.dtype, kernel, n: int, calls: int = 3) -> dict:
    ranks = SimulatedRanks(world, dtype)
    gen = torch.Generator().manual_seed(world * 1000 + n)
    exact, identical = True, True
    for _ in range(calls):
        xs = [torch.randn(n, generator=gen).to(dtype) for _ in range(world)]
        outs = ranks.run(kernel, xs)
        exact &= all(torch.equal(out, _rank_order_sum(xs)) for out in outs)
        identical &= all(torch.equal(out, outs[0]) for out in outs)
    return {"world": world, "dtype": str(dtype), "kernel": kernel.fn.__name__, "n": n, "exact": exact,
            "identical": identical, "errors": sum(int(e) for e in ranks.errors),
            "epochs": sorted({int(v) for e in ranks.epochs for v in e})}


def fused_scenario(world: int, rows: int, cols: int, split: int) -> dict:
    """The all-reduce fused with the residual add + RMSNorm, ``split`` programs to a row, against the rank-order sum
    and ``add_rmsnorm``'s rounding (float32)."""
    ranks = SimulatedRanks(world, torch.float32)
    gen = torch.Generator().manual_seed(world * 100 + rows * 10 + split)
    residual, weight = torch.randn(rows, cols, generator=gen), torch.rand(cols, generator=gen) + 0.5
    exact = close = True
    for _ in range(2):
        xs = [torch.randn(rows, cols, generator=gen) for _ in range(world)]
        epoch, want = int(ranks.epochs[0][0]) + 1, _rank_order_sum(xs)
        summed_want = want + residual
        normed_want = weight * summed_want * torch.rsqrt(summed_want.pow(2).mean(-1, keepdim=True) + 1e-5)
        for rank in range(world):
            for later in range(rank + 1, world):
                ranks.slots(rank)[epoch % 2, later, :rows * cols] = xs[later].flatten()
                ranks.flags(rank)[0, later] = epoch
            out, summed = torch.empty_like(residual), torch.empty_like(residual)
            one_shot_all_reduce_add_rmsnorm_kernel[(PROGRAMS,)](
                xs[rank], residual, weight, out, summed, rows, cols, 1e-5, ranks.bases, ranks.epochs[rank],
                ranks.errors[rank], RANK=rank,
                WORLD=world, PROGRAMS=PROGRAMS, BLOCK=cols, FLAG_BYTES=ranks.layout.flag_bytes,
                SLOT_ELEMS=ranks.layout.slot_elems(torch.float32), MAX_SPINS=1000, SPLIT=split)
            exact &= torch.equal(summed, summed_want)
            close &= torch.allclose(out, normed_want, rtol=1e-5, atol=1e-5)
    return {"fused": True, "world": world, "rows": rows, "split": split, "sums_exact": exact, "norms_close": close,
            "errors": sum(int(e) for e in ranks.errors)}


def starved() -> dict:
    """Rank 0 alone, its peer never pushes: the wait gives up after max_spins and counts an error."""
    ranks = SimulatedRanks(2, torch.float32)
    x = torch.ones(8)
    one_shot_all_reduce_kernel[(PROGRAMS,)](
        x, 8, ranks.bases, ranks.epochs[0], ranks.errors[0], RANK=0, WORLD=2, PROGRAMS=PROGRAMS, BLOCK=BLOCK,
        FLAG_BYTES=ranks.layout.flag_bytes, SLOT_ELEMS=ranks.layout.slot_elems(torch.float32), MAX_SPINS=5)
    pushed = ranks.slots(1)[1, 0, :8].tolist()
    return {"starved_errors": int(ranks.errors[0]), "peer_flags": ranks.flags(1)[0, 0].tolist(), "pushed": pushed}


def ptx_facts() -> dict:
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    facts = {}
    constants = {"RANK": 1, "WORLD": 2, "PROGRAMS": 32, "BLOCK": 2048, "FLAG_BYTES": 1024, "SLOT_ELEMS": 4 << 20,
                 "MAX_SPINS": 1 << 30, "PDL": True, "GO_AHEAD": True}
    tail = {"bases": "*i64", "epochs": "*i64", "errors": "*i32", **{name: "constexpr" for name in constants}}
    signatures = {one_shot_all_reduce_kernel: {"x": "*bf16", "n": "i32", **tail},
                  two_shot_all_reduce_kernel: {"x": "*bf16", "n": "i32", **tail},
                  one_shot_all_reduce_add_rmsnorm_kernel: {
                      **{name: "*bf16" for name in ("x", "residual", "weight", "out", "residual_out")},
                      "rows": "i32", "cols": "i32", "eps": "fp32", "bases": "*i64", "epochs": "*i64",
                      "errors": "*i32", **{name: "constexpr" for name in constants}, "SPLIT": "constexpr"}}
    fused = one_shot_all_reduce_add_rmsnorm_kernel
    variants = [(kernel.fn.__name__, kernel, signature,
                 {**constants, "SPLIT": 1} if kernel is fused else constants)
                for kernel, signature in signatures.items()]
    # The fused kernel also as the decode step runs it at one row of 8192: 4 programs to the row.
    variants.append((f"{fused.fn.__name__} split 4", fused, signatures[fused], {**constants, "SPLIT": 4}))
    for name, kernel, signature, kernel_constants in variants:
        pointers_and_sizes = [i for i, kind in enumerate(signature.values()) if kind.startswith("*") or kind == "i32"]
        aligned = {(i,): [["tt.divisibility", 16]] for i in pointers_and_sizes}  # what a launch specializes to
        source = ASTSource(fn=kernel, signature=signature, constexprs=kernel_constants, attrs=aligned)
        ptx = triton_compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
        facts[name] = {"release_flag": "atom.global.sys.release.exch.b64" in ptx,
                                     "acquire_wait": ".global.sys.acquire." in ptx,
                                     "vector_data": "st.global.v4.b32" in ptx, "multimem": "multimem" in ptx,
                                     "pdl": "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx}
    return facts


if __name__ == "__main__" and "--ptx" in sys.argv:
    print(json.dumps(ptx_facts()))
elif __name__ == "__main__":
    # Two ranks run concurrently in test_custom_all_reduce.py's process test; here four, one after another.
    for world, dtype, n in [(4, torch.float32, 37)]:
        for kernel in (one_shot_all_reduce_kernel, two_shot_all_reduce_kernel):
            print(json.dumps(scenario(world, dtype, kernel, n)))
    for rows, split in [(1, 4), (2, 2), (3, 1)]:
        print(json.dumps(fused_scenario(4, rows, 64, split)))
    print(json.dumps(starved()))
