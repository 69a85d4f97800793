"""``treadle bench lora --part gemv``: Llama-3.1-8B's 32 layers' linear work at decode sizes through the engine's own
layers and small-batch kernels (the Triton configs ``small_batch.choose`` times at load, cuBLAS where it wins, the
fused SiLU·mul and add + RMSNorm epilogues, the L2 prefetch chain), replayed from CUDA graphs: the base model, then
with a rank-``rank`` adapter on all seven projections (the ``triton`` backend) unfused (``fuse_gemv=0``: the
matmul, the shrink, the expand, then ``silu_mul`` or the norm) and split around the matmul (``fuse_gemv=1``,
kernels/lora_fused.py: the shrink in the matmul's launch, the expand with the layer's epilogue), and split with
every shrink tile (``fuse_tile`` unbounded: ``down_proj`` at bs=32 too), at bs=1 with one adapter and bs=32 with
32; then bs=32 again with every layer on cuBLAS (``TREADLE_SMALL_BATCH_MATMUL=library``'s layers: the split runs
the shrink apart, its expand still carrying SiLU·mul and add + RMSNorm; the base there is cuBLAS with the
``silu_mul`` and add + RMSNorm kernels). A layer runs ``qkv_proj``, ``o_proj`` with the residual add + ``post_attention_layernorm``,
``gate_up_proj`` with SiLU·mul, ``down_proj`` with the add + next ``input_layernorm``, as the decoder does; attention
and sampling are not in it, so the ratios are the linear layers' (the engine part measures whole steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator

import torch
from torch import nn

from treadle.bench.lora_kernels import NUM_LAYERS, _graph_seconds

CASES = ((1, 1), (32, 32))  # (tokens, adapters): token t has adapter t % adapters
LIBRARY_CASES = ((32, 32),)  # the same with every layer's matmul the library's (cuBLAS)
FORMS = {"unfused": {"fuse_gemv": 0}, "split": {"fuse_gemv": 1, "fuse_max_tokens": 64},
         "split_all": {"fuse_gemv": 1, "fuse_max_tokens": 64, "fuse_tile": 1 << 20}}
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128


class _Linears(nn.Module):
    """One decoder layer's linear layers and the norms their epilogues run, named as the model families name them
    (so ``core/lora/slots.py`` finds the projections)."""

    def __init__(self) -> None:
        from treadle.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
        from treadle.layers.norm import RMSNorm

        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS)
        self.self_attn.o_proj = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = MergedColumnParallelLinear(HIDDEN, {"gate_proj": INTERMEDIATE,
                                                                    "up_proj": INTERMEDIATE})
        self.mlp.down_proj = RowParallelLinear(INTERMEDIATE, HIDDEN)
        self.post_attention_layernorm = RMSNorm(HIDDEN)
        self.next_layernorm = RMSNorm(HIDDEN)

    def linears(self) -> list[nn.Module]:
        return [self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj]

    def step(self, inputs: dict[str, torch.Tensor]) -> None:
        from treadle.kernels.fused_ops import silu_mul

        self.self_attn.qkv_proj(inputs["hidden"])
        o_proj, down_proj = self.self_attn.o_proj, self.mlp.down_proj
        fused = o_proj.forward_add_rmsnorm(inputs["attended"], inputs["residual"], self.post_attention_layernorm)
        if fused is None:
            fused = self.post_attention_layernorm(o_proj(inputs["attended"]), inputs["residual"])
        activated = self.mlp.gate_up_proj.forward_silu_mul(fused[0])
        if activated is None:
            activated = silu_mul(self.mlp.gate_up_proj(fused[0]))
        if down_proj.forward_add_rmsnorm(activated, fused[1], self.next_layernorm) is None:
            self.next_layernorm(down_proj(activated), fused[1])


def run_gemv_cases(rank: int, slots: int = 32, replays: int = 20) -> list[dict[str, Any]]:
    """Per case: device milliseconds per 32-layer step of the base layers, with the adapters unfused, and split;
    the ratios to the base; what each weight shape runs (``small_batch.choices()``)."""
    from treadle.core.lora.slots import build_layer_slots
    from treadle.core.registry import build_registry
    from treadle.layers import small_batch

    dtype, device = torch.bfloat16, torch.device("cuda")
    model = _build_model(dtype, device)
    layers = list(model.layers)
    cases = [(tokens, adapters, False) for tokens, adapters in CASES]
    cases += [(tokens, adapters, True) for tokens, adapters in LIBRARY_CASES]
    inputs = {case: _inputs(case[0], dtype, device) for case in cases}
    base_s = {}
    for case in cases:  # before the adapters are registered: the layers' own fused epilogues
        with _library_matmuls(layers, case[2]):
            base_s[case] = _graph_seconds(lambda: _step(layers, inputs[case]), replays)
    backend = build_registry().get("lora_backends", "triton")(slots, rank, device, dtype)
    with torch.inference_mode():
        for projection in build_layer_slots(model, backend, slots, rank, device, dtype).values():
            projection.a.normal_(std=0.02)
            projection.b.normal_(std=0.02)
            projection.scalings.fill_(2.0)
            projection.ranks.fill_(rank)
            if projection.dense_b is not None:
                projection.dense_b.normal_(std=0.02)
    rows = []
    for case in cases:
        with _library_matmuls(layers, case[2]):
            rows.append(_case_row(layers, backend, case, inputs[case], base_s[case], rank, replays))
    for row in rows:
        row["small_batch"] = small_batch.choices()
    return rows


def _case_row(layers: list[_Linears], backend: Any, case: tuple[int, int, bool], inputs: dict[str, torch.Tensor],
              base_s: float, rank: int, replays: int) -> dict[str, Any]:
    """One case's row: the base layers' time, then each of ``FORMS``'s and its ratio to the base."""
    from treadle.core.execution.batch_context import BatchContext, using_batch_context

    tokens, adapters, library = case
    device = torch.device("cuda")
    context = BatchContext(torch.arange(tokens, device=device), torch.arange(tokens, device=device) % adapters)
    row = {"case": f"bs={tokens}, {adapters} adapter{'s' if adapters > 1 else ''}{', cuBLAS' if library else ''}",
           "tokens": tokens, "adapters": adapters, "rank": rank, "library": library, "base_ms": 1e3 * base_s}
    default = backend.kernel_choice
    try:
        for form, fields in FORMS.items():
            backend.kernel_choice = dataclasses.replace(default, **fields)
            with using_batch_context(context):
                seconds = _graph_seconds(lambda: _step(layers, inputs), replays)
            row[f"{form}_ms"], row[f"{form}_ratio"] = 1e3 * seconds, seconds / base_s
    finally:
        backend.kernel_choice = default
    print(f"{row['case']}: base {row['base_ms']:.3f} ms, " + ", ".join(
        f"{form} {row[f'{form}_ms']:.3f} ms ({row[f'{form}_ratio']:.3f}x)" for form in FORMS), flush=True)
    return row


@contextlib.contextmanager
def _library_matmuls(layers: list[_Linears], library: bool) -> Iterator[None]:
    """With ``library``, every linear layer on the library matmul (what ``TREADLE_SMALL_BATCH_MATMUL=library``
    loads), its small-batch choice restored after."""
    linears = [linear for layer in layers for linear in layer.linears()]
    chosen = [linear.small_batch for linear in linears]
    if library:
        for linear in linears:
            linear.small_batch = None
    try:
        yield
    finally:
        for linear, kernels in zip(linears, chosen):
            linear.small_batch = kernels


def format_gemv_table(rows: list[dict[str, Any]]) -> str:
    lines = ["LoRA through the engine's small-batch layers (7 projections x 32 layers, linear work only)",
             f"{'case':30s} {'base ms':>8s}" + "".join(f" {form + ' ms':>13s} {'ratio':>6s}" for form in FORMS)]
    for row in rows:
        lines.append(f"{row['case']:30s} {row['base_ms']:8.3f}" + "".join(
            f" {row[f'{form}_ms']:13.3f} {row[f'{form}_ratio']:6.3f}" for form in FORMS if f"{form}_ms" in row))
    if rows:
        lines += [f"  {shape}: {choice}" for shape, choice in rows[0]["small_batch"].items()]
    return "\n".join(lines)


def _build_model(dtype: torch.dtype, device: torch.device) -> nn.Module:
    """32 layers of random weights, their small-batch kernels chosen (timed per shape, as at load) and chained for
    the L2 prefetch as the engine chains them."""
    from treadle.layers.small_batch import chain_l2_prefetch

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = nn.Module()
            model.layers = nn.ModuleList(_Linears() for _ in range(NUM_LAYERS))
    finally:
        torch.set_default_dtype(default)
    linears = [linear for layer in model.layers for linear in layer.linears()]
    with torch.no_grad():
        for linear in linears:
            linear.weight.normal_(std=0.02)
            linear.quant_method.process_weights_after_loading(linear)
        for layer in model.layers:
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
            layer.next_layernorm.weight.uniform_(0.5, 1.5)
    chain_l2_prefetch(linears)
    return model


def _inputs(tokens: int, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    return {name: torch.randn(tokens, width, dtype=dtype, device=device)
            for name, width in (("hidden", HIDDEN), ("attended", HEADS * HEAD_DIM), ("residual", HIDDEN))}


def _step(layers: list[_Linears], inputs: dict[str, torch.Tensor]) -> None:
    for layer in layers:
        layer.step(inputs)
