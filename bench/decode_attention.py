"""The Triton decode-attention kernel alone: device time per layer for one new token per request.

``python -m treadle.bench.decode_attention [--batch-sizes 1,4,32] [--context 576,2048]
[--variants "min_split_tokens=128,min_split_tokens=64;decode_block_n=32"] [--output PATH]``

Llama-3.1-8B's attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16 KV) by default. Each
(batch size, context) runs every variant (``;``-separated ``name=value`` settings of the Triton backend's decode
tunables: ``max_kv_splits``, ``min_split_tokens``, ``decode_block_n``, ``num_stages``, ``target_programs``; the
defaults here are the kernel's plain ones, not the backend's choices per batch) over ``--layers`` separate KV
caches, so that, as in a decode step, each call reads KV that the previous call did not leave in L2; it stores the
step's new K/V as the model's step does. On CUDA the calls are replayed from a CUDA graph (no launch gaps); elsewhere
(``TRITON_INTERPRET=1``, for a smoke test) they run eagerly. The table gives microseconds per layer, the KV bytes
read per second, the share of the copy bandwidth that is, each variant's speed ratio to the first one and the
largest difference between their outputs (layer 0).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from treadle.bench.one_batch_report import machine_info
from treadle.bench.roofline import measure_copy_bandwidth, synchronize

TUNABLES = {"max_kv_splits": 16, "min_split_tokens": 128, "decode_block_n": 64, "num_stages": 2, "target_programs": 0}


def parse_variant(spec: str) -> dict[str, int]:
    """``"min_split_tokens=64;decode_block_n=32"`` -> the tunables with those two changed ("" = defaults)."""
    settings = dict(TUNABLES)
    for item in filter(None, spec.split(";")):
        name, _, value = item.partition("=")
        if name not in TUNABLES or not value.isdigit():
            raise SystemExit(f"--variants: '{item}' is not NAME=INTEGER with NAME one of {', '.join(TUNABLES)}")
        settings[name] = int(value)
    return settings


class DecodeCase:
    """The tensors of ``layers`` layers' decode attention for ``bs`` requests of ``context`` tokens each."""

    def __init__(self, bs: int, context: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                 max_kv_splits: int, device: torch.device, dtype: torch.dtype) -> None:
        generator = torch.Generator(device="cpu").manual_seed(0)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

        slots = bs * context + 1  # slot 0 is the pool's padding slot
        self.caches = [(randn(slots, kv_heads, head_dim), randn(slots, kv_heads, head_dim)) for _ in range(layers)]
        self.q = randn(bs, heads, head_dim)
        self.k_new, self.v_new = randn(bs, kv_heads, head_dim), randn(bs, kv_heads, head_dim)
        self.out = torch.empty_like(self.q)
        self.req_to_token = (1 + torch.arange(bs * context, dtype=torch.int32)).view(bs, context).to(device)
        self.req_pool_indices = torch.arange(bs, device=device)
        self.seq_lens = torch.full((bs,), context, dtype=torch.int64, device=device)
        self.new_loc = self.req_to_token[:, -1].to(torch.int64)
        self.mid_o = torch.empty(bs, heads, max_kv_splits, head_dim, dtype=torch.float32, device=device)
        self.mid_lse = torch.empty(bs, heads, max_kv_splits, dtype=torch.float32, device=device)
        self.arrivals = torch.zeros(bs * kv_heads, dtype=torch.int32, device=device)
        self.kv_bytes_per_layer = 2 * bs * context * kv_heads * head_dim * self.caches[0][0].element_size()

    def run(self, layer: int, settings: dict[str, int]) -> None:
        from treadle.plugins.attention.triton.decode import decode_attention

        k_cache, v_cache = self.caches[layer % len(self.caches)]
        decode_attention(self.q, k_cache, v_cache, self.out, self.req_to_token, self.req_pool_indices,
                         self.seq_lens, self.mid_o, self.mid_lse, self.arrivals, self.q.shape[-1] ** -0.5, None,
                         settings["max_kv_splits"], settings["min_split_tokens"], settings["decode_block_n"],
                         new_kv=(self.k_new, self.v_new, self.new_loc), num_stages=settings["num_stages"],
                         target_programs=settings["target_programs"])


def seconds_per_layer(case: DecodeCase, settings: dict[str, int], device: torch.device) -> float:
    layers = len(case.caches)
    if device.type == "cuda":
        from treadle.layers.small_batch import graph_seconds

        return graph_seconds(lambda i: case.run(i, settings), per_graph=layers)
    case.run(0, settings)  # compiles
    start = time.perf_counter()
    for layer in range(layers):
        case.run(layer, settings)
    return (time.perf_counter() - start) / layers


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m treadle.bench.decode_attention")
    parser.add_argument("--batch-sizes", default="1,4,32")
    parser.add_argument("--context", default="576,2048", help="keys per request, the new one included")
    parser.add_argument("--variants", default="", help="comma-separated; each ';'-separated NAME=VALUE tunables")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head_dim")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", help="JSON path (default: none)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    variants = args.variants.split(",") if args.variants else [""]
    settings = [parse_variant(v) for v in variants]
    bandwidth = measure_copy_bandwidth(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows: list[dict[str, Any]] = []
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; {args.layers} layers, {heads}/{kv_heads} heads, "
          f"head_dim {head_dim}, {dtype}")
    print(f"{'bs':>4} {'keys':>6}  {'variant':<40} {'us/layer':>9} {'KV GB/s':>8} {'% copy bw':>9} {'vs first':>8} {'max |diff|':>9}")
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        for context in (int(c) for c in args.context.split(",")):
            case = DecodeCase(bs, context, args.layers, heads, kv_heads, head_dim,
                              max(s["max_kv_splits"] for s in settings), device, dtype)
            first, first_out = None, None
            for label, setting in zip(variants, settings):
                seconds = seconds_per_layer(case, setting, device)
                case.run(0, setting)
                synchronize(device)
                first = first or seconds
                first_out = case.out.float().clone() if first_out is None else first_out
                diff = (case.out.float() - first_out).abs().max().item()
                rate = case.kv_bytes_per_layer / seconds
                rows.append({"bs": bs, "context": context, "variant": label or "defaults", "settings": setting,
                             "us_per_layer": seconds * 1e6, "kv_bytes_per_s": rate,
                             "fraction_of_copy_bandwidth": rate / bandwidth, "vs_first": first / seconds,
                             "max_abs_diff_vs_first": diff})
                print(f"{bs:>4} {context:>6}  {label or 'defaults':<40} {seconds * 1e6:>9.2f} {rate / 1e9:>8.0f} "
                      f"{100 * rate / bandwidth:>8.1f}% {first / seconds:>7.2f}x {diff:>9.1e}")
            del case
            synchronize(device)
    if args.output:
        Path(args.output).write_text(json.dumps({
            "benchmark": "decode_attention", "command": "python -m treadle.bench.decode_attention "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine_info(device),
            "copy_bandwidth_bytes_per_s": bandwidth, "results": rows}, indent=2))
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
