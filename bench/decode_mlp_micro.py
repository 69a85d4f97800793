"""Throwaway micro-benchmark of the decode-MLP experiment (decode_mlp_kernels.py): the one-launch and three-launch forms against the separate small-batch kernels, per tile config and CTAs per SM. Run from the repo root on a GPU: python3 bench/decode_mlp_micro.py fp8,bf16 TILES CTAS."""
import os, sys, json, torch
import torch.nn.functional as F
sys.path.insert(0, "tests/gpu")
from treadle.plugins.models import decode_mlp_kernels as d, small_batch
from treadle.plugins.models.small_batch_kernels import FP8_CONFIGS, SIXTEEN_BIT_CONFIGS
from treadle.plugins.models.fp8_ops import fp8_matmul, quantize_per_token
from test_decode_mlp_gpu import _weights
DEV = torch.device("cuda")
import logging; logging.basicConfig(level=logging.WARNING); logging.getLogger("treadle.plugins.models.decode_mlp_kernels").setLevel(logging.INFO)
x = torch.randn(1, 4096, device=DEV).to(torch.bfloat16); r = torch.randn(1, 4096, device=DEV).to(torch.bfloat16)
out = {}
for kind in sys.argv[1].split(","):
    ws = [_weights(kind) for _ in range(2)]
    w = ws[0]
    def choose(weight, scale):
        lib = F.linear if scale is None else (lambda a, b: fp8_matmul(*quantize_per_token(a), b, scale, torch.bfloat16))
        return small_batch.choose(kind, weight, scale, torch.bfloat16, lib, FP8_CONFIGS if scale is not None else SIXTEEN_BIT_CONFIGS)
    ko, kgu, kd = choose(w.o_proj, w.o_scale), choose(w.gate_up, w.gate_up_scale), choose(w.down, w.down_scale)
    print(kind, "separate choices:", ko.describe(), "|", kgu.describe(), "|", kd.describe(), flush=True)
    def separate(i):
        w = ws[i % 2]
        n, s = small_batch.add_rmsnorm_matmul(ko, x, w.o_proj, w.o_scale, r, w.post_norm, w.post_eps)
        a = small_batch.silu_mul_matmul(kgu, n, w.gate_up, w.gate_up_scale)
        return small_batch.add_rmsnorm_matmul(kd, a, w.down, w.down_scale, s, w.next_norm, w.next_eps)
    t = small_batch.graph_seconds(separate) * 1e6
    out[f"{kind} separate"] = t; print(f"{kind} separate {t:.1f} us", flush=True)
    for tiles in sys.argv[2].split(","):
        os.environ["TREADLE_DECODE_MLP_TILES"] = tiles
        for ctas in sys.argv[3].split(","):
            os.environ["TREADLE_DECODE_MLP_CTAS"] = ctas
            for persistent in (True, False):
                try:
                    t = small_batch.graph_seconds(lambda i: d.decode_mlp(x, r, ws[i % 2], persistent=persistent,
                                                  programs=None if persistent else 132 * int(ctas))) * 1e6
                except Exception as e:
                    print(kind, tiles, ctas, "failed", repr(e)[:300]); continue
                res = {k[1]: v for k, v in d._resident.items() if k[1] == int(ctas)}
                out[f"{kind} {tiles} ctas={ctas} persistent={persistent}"] = t
                print(f"{kind} tiles={tiles} ctas={ctas} persistent={persistent}: {t:.1f} us  resident={list(d._resident.values())[-1] if d._resident else None} gave_up={int(d.counters(DEV)[3])}", flush=True)
    d._resident.clear()
json.dump(out, open(os.environ.get("OUT", "/tmp") + "/micro.json", "w"), indent=1)
