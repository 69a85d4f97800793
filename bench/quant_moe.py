"""One Mixtral-8x7B MoE layer with W4A16 experts, every form of ``kernels/packed_int_moe.py`` against 16-bit experts,
per token count (``python -m treadle.bench.quant_kernels --moe``; ``--moe-only`` skips the dense shapes).

Per token count (8 experts of 4096 x 14336, top-2, random routing; symmetric groups of 128, or AWQ-style zero
points with ``--zeros``), each replayed from a CUDA graph: bf16 ``fused_experts``; W4A16 as the layer runs it
(``auto``: :func:`~treadle.kernels.packed_int_moe.choose_form`'s pick), then each form forced — the decode GEMVs
(up to 64 tokens), the grouped GEMM that widens value slots (``grouped``), the magic-widening grouped GEMM
(``magic``: its default tiles, and from 256 tokens every launch of ``magic_trials``), and the experts dequantized
into a bf16 scratch then the 16-bit grouped GEMM (``dequant``). Each line: microseconds, TFLOPS, the speed-up over
bf16, the fraction of the W4A16 memory roofline (each routed expert's packed bytes read once). Then the widening
alone (both GEMMs' experts, GB/s of its reads and writes) and, per token count, the fastest form: what
``choose_form`` should pick (``DEQUANT_ROWS_PER_EXPERT`` and ``default_magic_tiles`` are the knobs).
"""

from __future__ import annotations

import torch

MIXTRAL_MOE = (8, 4096, 14336, 2)  # experts, hidden, intermediate, top-k
MOE_TOKENS = "1,16,64,256,512,2048,8192"


def moe_rows(tokens_list: list[int], bandwidth: float, device: torch.device, zeros: bool = False) -> list[dict]:
    """The timings above, one dict per (token count, form, tiles)."""
    from treadle.kernels.fused_moe import fused_experts
    from treadle.kernels.packed_int_moe import choose_form, fused_int_experts
    from treadle.kernels.packed_int_moe_magic import default_magic_tiles, magic_trials
    from treadle.layers.fused_moe import route_top_k

    experts, hidden, inter, top_k = MIXTRAL_MOE
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16) * 0.01
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=torch.bfloat16) * 0.01
    packed = []
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        packed += [torch.randint(-2**31, 2**31 - 1, (experts, n, k // 8), dtype=torch.int32, device=device),
                   (torch.rand(experts, n, k // 128, device=device) * 0.002 + 0.001).to(torch.bfloat16),
                   torch.randint(0, 16, (experts, n, k // 128), device=device).to(torch.bfloat16) if zeros else None]
    scratch = torch.empty(experts * inter * hidden, dtype=torch.bfloat16, device=device)  # as the layer's
    expert_bytes = sum(t.numel() * t.element_size() for t in packed if t is not None) // experts
    rows = [_widening_row(packed, scratch, bandwidth)]
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        weights, ids = route_top_k(torch.randn(tokens, experts, device=device), top_k)
        flops = 2 * tokens * top_k * 3 * hidden * inter
        roofline_s = ids.unique().numel() * expert_bytes / bandwidth
        timer = _timer(tokens)
        bf16_s = timer(lambda i: fused_experts(x, w13, w2, weights, ids))
        auto = choose_form(tokens, top_k, experts, hidden, inter, 4, 128, x.dtype, True)
        runs = [("auto", None, auto)]
        if tokens <= 64:
            runs.append(("gemv", None, "gemv"))
        runs += [("grouped", None, "grouped"), ("dequant", None, "dequant")]
        magic = [default_magic_tiles(tokens * top_k, experts)] + (
            magic_trials(tokens * top_k, experts)[1:] if tokens >= 256 else [])
        runs += [("magic", tiles, "magic") for tiles in magic]
        for name, tiles, form in runs:
            try:
                seconds = timer(lambda i, form=form, tiles=tiles: fused_int_experts(
                    x, *packed, weights, ids, 4, 128, scratch, form=form, tiles=tiles))
            except Exception as exc:  # a launch that does not compile here is reported, not fatal
                print(f"mixtral moe T={tokens} {name} {tiles}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            label = f"{name} ({auto})" if name == "auto" else name
            rows.append({"tokens": tokens, "form": name, "picked": auto if name == "auto" else name,
                         "tiles": str(tiles) if tiles else "", "us": seconds * 1e6, "bf16_us": bf16_s * 1e6,
                         "tflops": flops / seconds / 1e12, "speedup": bf16_s / seconds,
                         "roofline_fraction": roofline_s / seconds})
            print(f"mixtral moe T={tokens:<5} {label:<18} {seconds * 1e6:9.1f} us {flops / seconds / 1e12:6.1f} TFLOPS"
                  f"  bf16 {bf16_s * 1e6:9.1f} us  {bf16_s / seconds:5.2f}x  {roofline_s / seconds:5.0%} of roofline"
                  f"  {tiles or ''}")
    print(summary(rows))
    return rows


def summary(rows: list[dict]) -> str:
    """Per token count: the fastest of each form, and which form won."""
    from treadle.kernels.packed_int_moe import FORMS

    lines = ["", f"{'tokens':>7}{'bf16 us':>10}{'auto':>20}" + "".join(f"{form:>11}" for form in FORMS) + "  fastest"]
    for tokens in sorted({r["tokens"] for r in rows if "tokens" in r}):
        timed = [r for r in rows if r.get("tokens") == tokens]
        best = {form: min((r["us"] for r in timed if r["form"] == form), default=None)
                for form in ("auto", *FORMS)}
        auto = next((r for r in timed if r["form"] == "auto"), None)
        winner = min((r for r in timed if r["form"] != "auto"), key=lambda r: r["us"])
        cells = "".join(f"{best[form]:>11.1f}" if best[form] else f"{'-':>11}" for form in FORMS)
        auto_cell = f"{auto['us']:.1f} ({auto['picked']})" if auto else "-"
        lines.append(f"{tokens:>7}{timed[0]['bf16_us']:>10.1f}{auto_cell:>20}{cells}  {winner['form']} "
                     f"{winner['tiles']}")
    lines.append(_threshold_line(rows))
    return "\n".join(lines)


def _threshold_line(rows: list[dict]) -> str:
    """Where the dequant form starts to win for good: the token count from which it beats every other form at every
    larger count, as rows per expert (``DEQUANT_ROWS_PER_EXPERT``)."""
    experts, _, _, top_k = MIXTRAL_MOE
    counts = sorted({r["tokens"] for r in rows if "tokens" in r})
    wins = {t: min((r for r in rows if r.get("tokens") == t and r["form"] != "auto"),
                   key=lambda r: r["us"])["form"] == "dequant" for t in counts}
    first = next((t for t in counts if all(wins[u] for u in counts if u >= t)), None)
    if first is None:
        return "dequant wins at no measured token count: DEQUANT_ROWS_PER_EXPERT above the largest measured"
    return (f"dequant wins from {first} tokens on ({first * top_k / experts:.0f} rows per expert): "
            f"DEQUANT_ROWS_PER_EXPERT between the previous count's rows per expert and that")


def _timer(tokens: int):
    from treadle.layers.small_batch import graph_seconds

    # Fewer calls per graph for the long batches (tens of ms a call): the whole sweep stays near two minutes.
    if tokens >= 2048:
        return lambda run: graph_seconds(run, per_graph=2, replays=3)
    return graph_seconds


def _widening_row(packed: list, scratch: torch.Tensor, bandwidth: float) -> dict:
    """The widening alone of one layer's experts into ``scratch``, as the dequant form runs it."""
    from treadle.kernels.packed_int_moe import dequantize_experts
    from treadle.layers.small_batch import graph_seconds

    def widen(i: int) -> None:  # as the dequant form widens them: gate rows, up rows, down
        words, scales, zeros = packed[:3]
        half = words.shape[1] // 2
        for rows in (slice(0, half), slice(half, None)):
            dequantize_experts(words[:, rows], scales[:, rows], zeros[:, rows] if zeros is not None else None, 4,
                               128, scratch)
        dequantize_experts(*packed[3:], 4, 128, scratch)

    seconds = graph_seconds(widen, per_graph=4, replays=3)
    moved = sum(t.numel() * t.element_size() for t in packed if t is not None) + 3 * scratch.numel() * 2
    print(f"mixtral moe widening of one layer's experts (both GEMMs): {seconds * 1e6:.1f} us, "
          f"{moved / seconds / 1e9:.0f} GB/s ({moved / bandwidth / seconds:.0%} of the copy bandwidth)")
    return {"widening_us": seconds * 1e6, "widening_GBps": moved / seconds / 1e9,
            "widening_fraction": moved / bandwidth / seconds}
