"""Does prefetching the next GEMV's weight into L2 on a side stream, while a latency-bound kernel runs,
make the GEMV faster?  Micro-benchmark, bf16 bs=1, cuBLAS GEMV."""
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _prefetch_load(ptr, n_elem, sink, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for it in range(ITERS):
        offs = (pid * ITERS + it) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(ptr + offs, mask=offs < n_elem, other=0, eviction_policy="evict_last")
        acc = acc ^ x.to(tl.int16, bitcast=True).to(tl.int32)
    s = tl.sum(acc)
    tl.store(sink + pid, s, mask=s == 0x7FFFFFF1)


@triton.jit
def _prefetch_hint(ptr, n_lines, sink, LINES: tl.constexpr):
    pid = tl.program_id(0)
    line = pid * LINES + tl.arange(0, LINES)
    ptrs = ptr + line.to(tl.int64) * 64  # 64 bf16 = 128 bytes per line
    r = tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    s = tl.sum(r)
    tl.store(sink + pid, s, mask=s == 0x7FFFFFF1)


@triton.jit
def _prefetch_bulk(ptr, sink, SUB: tl.constexpr):
    pid = tl.program_id(0)
    ptrs = ptr + (pid * 32 + tl.arange(0, 32)).to(tl.int64) * (SUB // 2)
    r = tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], " + str(SUB) + ";\n mov.u32 $0, 0;",
                                  "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
    s = tl.sum(r)
    tl.store(sink + pid, s, mask=s == 0x7FFFFFF1)


sink = None


def prefetch(kind: str, w: torch.Tensor, frac: float = 1.0) -> None:
    n = int(w.numel() * frac)
    if kind == "load":
        block, iters = 2048, 8
        grid = triton.cdiv(n, block * iters)
        _prefetch_load[(grid,)](w, n, sink, BLOCK=block, ITERS=iters, num_warps=8)
    elif kind == "hint":
        lines = n // 64
        per = 1024
        _prefetch_hint[(triton.cdiv(lines, per),)](w, lines, sink, LINES=per, num_warps=8)
    elif kind == "bulk":
        sub = 4096  # bytes per lane, 128 KiB per program
        nbytes = n * 2
        _prefetch_bulk[(nbytes // (sub * 32),)](w, sink, SUB=sub, num_warps=1)
    else:
        raise ValueError(kind)


def time_graph(fn, reps=20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps * 1000  # us per replay


def main() -> None:
    global sink
    torch.manual_seed(0)
    dev = torch.device("cuda")
    sink = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
    results = {}
    shapes = {"o": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}
    sleep_cycles = [0, 10000, 30000]
    side = torch.cuda.Stream(priority=0)
    for name, (n_out, k) in shapes.items():
        copies = max(4, int(2.0e9 // (n_out * k * 2)))
        ws = [torch.randn(n_out, k, device=dev, dtype=torch.bfloat16) * 0.01 for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(1, n_out, device=dev, dtype=torch.bfloat16)

        def plain(cycles):
            def fn():
                for w in ws:
                    if cycles:
                        torch.cuda._sleep(cycles)
                    torch.matmul(x, w.t(), out=out)
            return fn

        def sidepf(cycles, kind, frac):
            def fn():
                main = torch.cuda.current_stream()
                for w in ws:
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        prefetch(kind, w, frac)
                    if cycles:
                        torch.cuda._sleep(cycles)
                    torch.matmul(x, w.t(), out=out)
                main.wait_stream(side)
            return fn

        def serialpf(kind):
            def fn():
                for w in ws:
                    prefetch(kind, w)
                    torch.matmul(x, w.t(), out=out)
            return fn

        def pf_only(kind):
            def fn():
                for w in ws:
                    prefetch(kind, w)
            return fn

        r = {}
        mb = n_out * k * 2 / 1e6
        for c in sleep_cycles:
            r[f"plain sleep={c}"] = time_graph(plain(c)) / len(ws)
            if c:
                r[f"sleep only {c}"] = time_graph(lambda c=c: [torch.cuda._sleep(c) for _ in ws]) / len(ws)
        for kind in ("load", "hint", "bulk"):
            try:
                r[f"prefetch only {kind}"] = time_graph(pf_only(kind)) / len(ws)
                r[f"serial prefetch+gemv {kind}"] = time_graph(serialpf(kind)) / len(ws)
                for c in sleep_cycles[1:]:
                    for frac in (0.5, 1.0):
                        r[f"side {kind} frac={frac} sleep={c}"] = time_graph(sidepf(c, kind, frac)) / len(ws)
            except Exception as e:  # noqa: BLE001
                r[f"{kind} error"] = repr(e)[:300]
        print(f"== {name} {n_out}x{k} ({mb:.0f} MB, {len(ws)} copies)")
        for key, v in r.items():
            if isinstance(v, float):
                print(f"  {key:42s} {v:8.2f} us  ({mb / v:.2f} TB/s if weight-only)")
            else:
                print(f"  {key:42s} {v}")
        results[name] = r
        del ws
        torch.cuda.empty_cache()
    json.dump(results, open(sys.argv[1] if len(sys.argv) > 1 else "/tmp/l2.json", "w"), indent=1)


if __name__ == "__main__":
    main()
