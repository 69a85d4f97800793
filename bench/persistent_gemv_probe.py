"""Experiment: a persistent one-token GEMV in plain Triton (grid = programs per SM x SMs, each program looping over
row tiles), launched with PDL, letting the next kernel start once each program begins its last tile."""
import sys
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from treadle.bench.gemv_tma_probe import SHAPES, fp8_weight, graph_time  # noqa: E402


@triton.jit
def persistent_gemv(X, W, Scale, Y, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EARLY: tl.constexpr, HAS_SCALE: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles = N // BLOCK_N
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, BLOCK_N)
    w_next = tl.load(W + (pid * BLOCK_N + rows)[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                     eviction_policy="evict_first")
    gdc_wait()
    for tile in range(pid, tiles, programs):
        offs_n = tile * BLOCK_N + rows
        w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        acc = tl.sum(w_next.to(tl.float32) * tl.load(X + offs_k).to(tl.float32)[None, :], axis=1)
        for k in range(BLOCK_K, K, BLOCK_K):
            w = tl.load(w_ptrs + k, eviction_policy="evict_first")
            acc += tl.sum(w.to(tl.float32) * tl.load(X + k + offs_k).to(tl.float32)[None, :], axis=1)
        nxt = tile + programs
        if EARLY:
            if nxt >= tiles:
                gdc_launch_dependents()
        nrows = nxt * BLOCK_N + rows
        w_next = tl.load(W + nrows[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                         mask=(nrows < N)[:, None], other=0.0, eviction_policy="evict_first")
        if HAS_SCALE:
            acc = acc * tl.load(Scale + offs_n)
        tl.store(Y + offs_n, acc.to(Y.dtype.element_ty))
    if not EARLY:
        gdc_launch_dependents()


_SMS = {}


def gemv(x, w, s, cfg):
    bn, bk, warps, per_sm, early = cfg
    n, k = w.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if 0 not in _SMS:
        _SMS[0] = torch.cuda.get_device_properties(0).multi_processor_count
    grid = (min(n // bn, _SMS[0] * per_sm),)
    persistent_gemv[grid](x, w, s if s is not None else y, y, n, k, w.stride(0), BLOCK_N=bn, BLOCK_K=bk, EARLY=early,
                          HAS_SCALE=s is not None, num_warps=warps, num_stages=1, launch_pdl=True)
    return y


CONFIGS = [(4, 1024, 4, 4, True), (4, 2048, 4, 3, True), (8, 1024, 4, 2, True), (4, 1024, 4, 6, True),
           (8, 2048, 8, 2, True), (4, 1024, 4, 4, False), (4, 1024, 4, 8, True), (8, 1024, 8, 3, True),
           (2, 2048, 4, 6, True), (4, 512, 4, 8, True), (8, 512, 4, 6, True), (4, 2048, 8, 4, True)]


def main():
    from treadle.plugins.models import small_batch
    from treadle.plugins.models.small_batch import weight_copies
    from treadle.plugins.models.small_batch_kernels import FP8_CONFIGS, SIXTEEN_BIT_CONFIGS, small_batch_matmul
    from treadle.plugins.models.fp8_ops import fp8_matmul, quantize_per_token
    import torch.nn.functional as F

    best = {}
    for name, (n, k) in SHAPES.items():
        w, s = fp8_weight(n, k)
        copies = weight_copies(w)
        x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
        ref = x.float() @ (w.float() * s).t()
        rows = []
        for c in FP8_CONFIGS:
            if c.gemv:
                t = graph_time([lambda i=i, c=c: small_batch_matmul(x, copies[i], s, c) for i in range(len(copies))] * 4)
                rows.append((t / (4 * len(copies)), f"triton {c}", None))
        for cfg in CONFIGS:
            try:
                y = gemv(x, w, s, cfg)
                err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                t = graph_time([lambda i=i: gemv(x, copies[i], s, cfg) for i in range(len(copies))] * 4)
                rows.append((t / (4 * len(copies)), f"persistent {cfg} err {err:.1e}", cfg))
            except Exception as exc:
                print(name, cfg, "failed", str(exc).splitlines()[0][:150])
        rows.sort(key=lambda r: r[0])
        for t, label, _ in rows[:7]:
            print(f"fp8 {name:8s} {t * 1e6:7.2f} us {n * k / t / 1e9:6.0f} GB/s  {label}", flush=True)
        best[name] = next(c for _, _, c in rows if c is not None)
        del copies
        torch.cuda.empty_cache()
    print("best", best, flush=True)
    weights = []
    for _ in range(32):
        for name in ("qkv", "o", "gate_up", "down"):
            weights.append((name,) + fp8_weight(*SHAPES[name]))
    head = (torch.randn(128256, 4096, device="cuda") * 0.02).to(torch.bfloat16)
    xs = {k: torch.randn(1, k, device="cuda").to(torch.bfloat16) for k in (4096, 14336)}
    nbytes = sum(w.numel() for _, w, _ in weights) + head.numel() * 2
    kernels = {name: small_batch.choose("fp8", w, s, torch.bfloat16,
                                        lambda x, w, s=s: fp8_matmul(*quantize_per_token(x), w, s, torch.bfloat16),
                                        FP8_CONFIGS) for name, w, s in weights[:4]}
    head_kernels = small_batch.choose("bf16", head, None, torch.bfloat16, lambda x, w: F.linear(x, w),
                                      SIXTEEN_BIT_CONFIGS)

    class Layer:
        def __init__(self, w):
            self.weight = w

    layers = [Layer(w) for _, w, _ in weights] + [Layer(head)]
    small_batch.chain_l2_prefetch(layers)
    current = [lambda name=name, w=w, s=s, p=l.l2_prefetch: small_batch.matmul(kernels[name], xs[w.shape[1]], w, s, p)
               for (name, w, s), l in zip(weights, layers)]
    head_fn = lambda: small_batch.matmul(head_kernels, xs[4096], head, None, layers[-1].l2_prefetch)
    noprefetch = [lambda name=name, w=w, s=s: small_batch.matmul(kernels[name], xs[w.shape[1]], w, s, None)
                  for name, w, s in weights]
    sets = {"best": best, "uniform 4/1024/4/4": {k: (4, 1024, 4, 4, True) for k in best},
            "uniform 4/1024/4/6": {k: (4, 1024, 4, 6, True) for k in best},
            "best, late go-ahead": {k: c[:4] + (False,) for k, c in best.items()}}
    for _ in range(2):
        t = graph_time(current + [head_fn])
        print(f"chain current: {t * 1e3:.3f} ms {nbytes / t / 1e9:.0f} GB/s", flush=True)
        t = graph_time(noprefetch + [head_fn])
        print(f"chain current without L2 prefetch: {t * 1e3:.3f} ms {nbytes / t / 1e9:.0f} GB/s", flush=True)
        for label, cfgs in sets.items():
            fns = [lambda x=xs[w.shape[1]], w=w, s=s, c=cfgs[name]: gemv(x, w, s, c) for name, w, s in weights]
            t = graph_time(fns + [head_fn])
            print(f"chain persistent {label} {cfgs}: {t * 1e3:.3f} ms {nbytes / t / 1e9:.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
