"""Conformance of the peer-to-peer all-reduce against NCCL, on ``world_size`` local GPUs (or its fallback on CPUs).

    from treadle.testing.all_reduce import check_custom_all_reduce

    reports = check_custom_all_reduce(world_size=2)   # one dict per rank; AssertionError naming what broke

Each rank is a spawned process that joins a group, sets the peer all-reduce up as a server would
(``parallel.custom_all_reduce``) and, for every dtype, size and algorithm (one-shot and two-shot), checks:

- the result equals NCCL's sum of the same inputs within the dtype's rounding (a sum rounded once per rank count);
- repeated calls on the same input are bitwise identical, and every rank holds bitwise the same result;
- the same holds when the call is captured in a CUDA graph and replayed with new inputs copied in;
- no wait gave up (the kernels' error counter stays 0).

A rank that does not answer within ``timeout_s`` fails the check with every rank's state, never hangs it.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import tempfile
import time
import traceback
from typing import Any

import torch

KiB = 1024
DEFAULT_SIZES = (KiB, 8 * KiB + 6, 64 * KiB, 256 * KiB, 1024 * KiB, 8 * 1024 * KiB)
DEFAULT_DTYPES = ("bfloat16", "float16", "float32")


def check_custom_all_reduce(world_size: int = 2, device_type: str = "cuda", mode: bool | str = True,
                            sizes: tuple[int, ...] = DEFAULT_SIZES, dtypes: tuple[str, ...] = DEFAULT_DTYPES,
                            graphs: bool = True, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Run the conformance on ``world_size`` spawned ranks; returns each rank's report (rank order).

    ``mode`` is ``parallel.custom_all_reduce``. Where the peer all-reduce is not installed (auto on a CPU) the
    report's ``all_reduce`` says ``nccl`` and only ``tp_all_reduce``'s fallback is checked.
    """
    reports = run_ranks(world_size, _rank_conformance, (device_type, mode, sizes, dtypes, graphs), timeout_s)
    failures = [f"rank {r['rank']}: {f}" for r in reports for f in r.get("failures", [])]
    assert not failures, "peer all-reduce conformance failed:\n  " + "\n  ".join(failures[:40])
    return reports


def run_ranks(world_size: int, target: Any, args: tuple, timeout_s: float) -> list[dict[str, Any]]:
    """``target(rank, world_size, init_method, *args) -> dict`` in ``world_size`` spawned processes; their
    dicts in rank order. A rank that raises or runs past ``timeout_s`` fails with every rank's state."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(prefix="treadle-ar-"), "store")
    procs = [ctx.Process(target=_rank_entry, args=(results, target, rank, world_size, f"file://{store}", args),
                         daemon=True) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    reports: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(reports) < world_size and not any("error" in rep for rep in reports.values()):
            try:
                report = results.get(timeout=1.0)
                reports[report["rank"]] = report
            except queue.Empty:
                crashed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in reports]
                if crashed or time.monotonic() > deadline:
                    raise AssertionError(_timeout_message(world_size, reports, procs, timeout_s)) from None
    finally:
        for proc in procs:
            proc.join(timeout=10 if len(reports) == world_size else 1)
            if proc.is_alive():
                proc.kill()
    errors = [f"rank {r}: {rep['error']}" for r, rep in sorted(reports.items()) if "error" in rep]
    assert not errors, "a rank failed:\n" + "\n".join(errors)
    return [reports[r] for r in range(world_size)]


def _timeout_message(world_size: int, reports: dict, procs: list, timeout_s: float) -> str:
    missing = [r for r in range(world_size) if r not in reports]
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    return (f"rank(s) {missing} gave no report (died, or still running after {timeout_s:g} s; exit codes {codes}); "
            f"reports so far: "
            f"{[reports[r] for r in sorted(reports)]}")


def _rank_entry(results: Any, target: Any, rank: int, world_size: int, init_method: str, args: tuple) -> None:
    try:
        results.put({"rank": rank, **target(rank, world_size, init_method, *args)})
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})


def _rank_conformance(rank: int, world_size: int, init_method: str, device_type: str, mode: bool | str,
                      sizes: tuple[int, ...], dtypes: tuple[str, ...], graphs: bool) -> dict[str, Any]:
    from treadle.core.distributed.custom_all_reduce import setup_custom_all_reduce
    from treadle.core.distributed.parallel import destroy_tensor_parallel, init_tensor_parallel, tp_all_reduce

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    init_tensor_parallel(rank, world_size, init_method, device, timeout_s=120.0)
    try:
        fast = setup_custom_all_reduce(mode, device, nnodes=1, local_devices=list(range(world_size)))
        if fast is None:
            x = torch.full((5,), float(rank + 1), device=device)
            want = float(sum(range(1, world_size + 1)))
            ok = bool((tp_all_reduce(x) == want).all())
            return {"all_reduce": "nccl", "failures": [] if ok else [f"fallback sum {x.tolist()} != {want}"]}
        report = _conformance(fast, device, sizes, [getattr(torch, d) for d in dtypes], graphs)
        report["all_reduce"] = fast.describe()
        report["errors"] = fast.error_count()
        if report["errors"]:
            report["failures"].append(f"{report['errors']} flag waits gave up")
        return report
    finally:
        destroy_tensor_parallel()


def _conformance(fast: Any, device: torch.device, sizes: tuple[int, ...], dtypes: list[torch.dtype],
                 graphs: bool) -> dict[str, Any]:
    from treadle.core.distributed.custom_all_reduce import ONE_SHOT, TWO_SHOT

    failures: list[str] = []
    cases = exact = 0
    for dtype in dtypes:
        for nbytes in sizes:
            n = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
            if n * torch.empty((), dtype=dtype).element_size() > fast.plan.max_bytes:
                continue
            for algorithm in (ONE_SHOT, TWO_SHOT):
                label = f"{dtype} {nbytes} B {algorithm}"
                matched, problems = _check_eager(fast, algorithm, n, dtype, device, label)
                if graphs:
                    problems += _check_graph(fast, algorithm, n, dtype, device, label)
                failures += problems
                cases += 1
                exact += matched
    return {"failures": failures, "cases": cases, "exact_cases": exact}


def _check_eager(fast: Any, algorithm: str, n: int, dtype: torch.dtype, device: torch.device,
                 label: str) -> tuple[bool, list[str]]:
    x = _rank_input(n, dtype, device, salt=0)
    want = _nccl_sum(x)
    outs = [fast.reduce(x.clone(), algorithm) for _ in range(3)]
    problems = _compare(outs[0], want, _nccl_sum(x.float().abs()), f"{label} eager")
    if not all(torch.equal(out, outs[0]) for out in outs[1:]):
        problems.append(f"{label}: repeated calls differ")
    if not _same_on_every_rank(outs[0]):
        problems.append(f"{label}: ranks hold different results")
    return bool(torch.equal(outs[0], want)), problems


def _check_graph(fast: Any, algorithm: str, n: int, dtype: torch.dtype, device: torch.device,
                 label: str) -> list[str]:
    static = _rank_input(n, dtype, device, salt=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fast.reduce(static, algorithm)
    problems: list[str] = []
    for replay in range(1, 4):
        fresh = _rank_input(n, dtype, device, salt=replay)
        static.copy_(fresh)
        graph.replay()
        problems += _compare(static, _nccl_sum(fresh), _nccl_sum(fresh.float().abs()), f"{label} graph replay {replay}")
    del graph
    return problems


def _rank_input(n: int, dtype: torch.dtype, device: torch.device, salt: int) -> torch.Tensor:
    import torch.distributed as dist

    gen = torch.Generator(device="cpu").manual_seed(dist.get_rank() * 7919 + n * 31 + salt)
    return torch.randn(n, generator=gen).to(dtype).to(device)


def _nccl_sum(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    total = x.clone()
    dist.all_reduce(total)
    return total


def _compare(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor, label: str) -> list[str]:
    # NCCL rounds each partial sum to the dtype, in an order of its own; each rounding is at most an ulp of a partial
    # sum, and a partial sum is at most ``magnitude`` (the sum of the ranks' absolute values). The peer all-reduce
    # rounds once. So the two are at most one such ulp apart per rank (at 2 ranks both round once: equal).
    import torch.distributed as dist

    tol = torch.finfo(want.dtype).eps * dist.get_world_size() * (magnitude + 1e-3)
    off = (got.float() - want.float()).abs()
    bad = int((off > tol).sum())
    return [f"{label}: {bad} of {want.numel()} elements off NCCL's sum (max {float(off.max()):.3g})"] if bad else []


def _same_on_every_rank(x: torch.Tensor) -> bool:
    import torch.distributed as dist

    gathered = torch.empty((dist.get_world_size(),) + tuple(x.shape), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(gathered, x.contiguous())
    return all(torch.equal(gathered[r], gathered[0]) for r in range(gathered.shape[0]))
