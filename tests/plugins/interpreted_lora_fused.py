"""Run by test_lora_fused.py in a subprocess under TRITON_INTERPRET=1: the LoRA delta split around the layer's matmul
(kernels/lora_fused.py through ``layers/small_batch.split_matmul``: the shrink in the small-batch matmul's launch,
or apart beside a library matmul or where its tile is too large, the expand with the layer's epilogue) against the
unfused triton path (the matmul, ``add_delta``'s shrink and expand, then ``silu_mul`` / add + RMSNorm), bit for bit:
the kernels alone (a GEMV at one token, a split-K GEMV, tiles at 5 and 20 tokens, ``F.linear`` at 5, a tile whose
shrink runs apart; three, two and one stacked projections; mixed adapters and ranks, tokens without one), then a
tiny float16 Llama whose first layer runs the small-batch kernels and second ``F.linear`` (no config:
``TREADLE_SMALL_BATCH_MATMUL=library``), with the triton backend's adapters, ``fuse_gemv`` on and off.
Prints one ``RESULTS {json}``."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections import Counter
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hand_lora import HandSteps, model_config  # noqa: E402
from treadle.core.config import load_config  # noqa: E402
from treadle.core.execution.model_runner import ModelRunner  # noqa: E402
from treadle.core.lora.slots import build_layer_slots  # noqa: E402
from treadle.core.registry import build_registry  # noqa: E402
from treadle.kernels import fused, lora, lora_fused  # noqa: E402
from treadle.kernels.lora_choice import LoRAKernelChoice  # noqa: E402
from treadle.kernels.small_batch import SmallBatchConfig, small_batch_matmul  # noqa: E402
from treadle.layers import small_batch  # noqa: E402
from treadle.layers.linear import LinearBase  # noqa: E402
from treadle.plugins.lora_backends.triton import TritonLoRABackend  # noqa: E402
from treadle.testing.models import make_tiny_llama  # noqa: E402

GEMV = SmallBatchConfig(4, 64, 4, 3, gemv=True)
GEMV_SPLIT_K = SmallBatchConfig(16, 32, 4, 3, split_k=2, gemv=True)
TILE = SmallBatchConfig(16, 32, 4, 2)
SEGMENTS = {"qkv": ((0, 64), (64, 80), (80, 96)), "gate_up": ((0, 48), (48, 96)), "o_proj": ((0, 80),)}
# (layer, tokens, config, LoRA choice): split_k=32 makes the shrink write partial sums of 3 slices of in=96; config
# None is the library matmul (F.linear), the shrink apart; fuse_tile=16 runs the shrink apart beside a tile too; LOOP
# runs the looped shrink beside the tile (8 rows a program, chunks of 32: in=96 in slices of two chunks and one).
LOOP = LoRAKernelChoice(shrink_loop_above=16, shrink_loop_rows=8, shrink_loop_k=32, shrink_loop_programs=100,
                        shrink_loop_stages=1)
KERNEL_CASES = [("qkv", 1, GEMV, LoRAKernelChoice(split_k=32)), ("gate_up", 1, GEMV, LoRAKernelChoice()),
                ("o_proj", 1, GEMV, LoRAKernelChoice(split_k=32)), ("qkv", 1, GEMV_SPLIT_K, LoRAKernelChoice()),
                ("o_proj", 5, TILE, LoRAKernelChoice()), ("gate_up", 20, TILE, LoRAKernelChoice(split_k=32)),
                ("o_proj", 5, None, LoRAKernelChoice()), ("gate_up", 5, None, LoRAKernelChoice(split_k=32)),
                ("o_proj", 5, TILE, LoRAKernelChoice(fuse_tile=16)),
                ("qkv", 20, TILE, LOOP)]


def stacked(layer: str, tokens: int, seed: int, dtype: torch.dtype):
    """x, the base weight and 4 slots of stacked adapters (rank 8 padding; per projection ranks 8, 3, 0, 5, the
    last 2, 8, 4, 0), ids over the slots and -1."""
    gen = torch.Generator().manual_seed(seed)
    segments, rank_dim, slots, in_features = SEGMENTS[layer], 8, 4, 96
    count, width = len(segments), segments[-1][1]
    ranks = torch.tensor([[8, 3, 0, 5]] * (count - 1) + [[2, 8, 4, 0]], dtype=torch.int32)
    a = torch.randn(slots, count * rank_dim, in_features, generator=gen) / in_features ** 0.5
    b = torch.randn(slots, width, rank_dim, generator=gen) / rank_dim ** 0.5
    for p, (start, end) in enumerate(segments):
        for slot in range(slots):
            rank = int(ranks[p, slot])
            a[slot, p * rank_dim + rank:(p + 1) * rank_dim] = 0
            b[slot, start:end, rank:] = 0
    ids = torch.randint(-1, slots, (tokens,), generator=gen)
    ids[0] = 0  # at least one adapted token
    x = torch.randn(tokens, in_features, generator=gen).to(dtype)
    weight = (torch.randn(width, in_features, generator=gen) / in_features ** 0.5).to(dtype)
    scalings = torch.rand(count, slots, generator=gen) + 0.5
    return x, weight, (a.to(dtype), b.to(dtype), ids, scalings, ranks, segments)


def kernel_case(layer: str, tokens: int, config: SmallBatchConfig | None, choice: LoRAKernelChoice) -> dict:
    # bfloat16 where the GEMV or F.linear runs; the tiles' 16-bit tl.dot is right under the interpreter in float16 only
    x, weight, lora_args = stacked(layer, tokens, tokens,
                                   torch.bfloat16 if config is None or config.gemv else torch.float16)
    kernels = None if config is None else small_batch.SmallBatchKernels((config,) * len(small_batch.ROW_BUCKETS))
    base = F.linear(x, weight) if config is None else small_batch_matmul(x, weight, None, config)
    unfused = base.clone()
    lora.add_delta(x, *lora_args, unfused, choice)
    split = lora_fused.split_lora(x, *lora_args, choice)
    assert (split.beside is None) == (choice.fuse_tile < 8192)  # a tile too large for a matmul launch: apart

    def split_matmul(**epilogue):
        return small_batch.split_matmul(kernels, x, weight, lambda: split, library=F.linear, **epilogue)

    if layer == "qkv":
        expected, got = unfused, split_matmul()
    elif layer == "gate_up":
        expected, got, base = fused.silu_mul(unfused), split_matmul(silu_mul=True), fused.silu_mul(base)
    else:
        gen = torch.Generator().manual_seed(1)
        residual = torch.randn(tokens, 80, generator=gen).to(x.dtype)
        norm_weight = (torch.rand(80, generator=gen) + 0.5).to(x.dtype)
        if tokens == 1 and config.gemv:  # the one-token GEMV fuses add + RMSNorm after the delta
            moved = residual.clone()
            lora.add_delta(x, *lora_args, moved, choice)
            expected = small_batch_matmul(x, weight, None, config, add_rmsnorm=(moved, norm_weight, 1e-5))
        else:
            expected = fused.add_rmsnorm(unfused, residual, norm_weight, 1e-5)
        got = split_matmul(add_rmsnorm=(residual, norm_weight, 1e-5))
        expected, got, base = torch.cat(expected, 1), torch.cat(got, 1), torch.cat(
            fused.add_rmsnorm(base, residual, norm_weight, 1e-5), 1)
    return {"equal": torch.equal(expected, got), "delta": (expected.float() - base.float()).abs().max().item()}


REGISTRY = build_registry(["treadle.plugins.models.llama", "treadle.plugins.attention.torch_native",
                           "treadle.plugins.kv_allocators.token"], load_entry_points=False)
calls = Counter()


def counted(name, function):
    def run(*args, **kwargs):
        calls[name] += 1
        return function(*args, **kwargs)
    return run


for _name in ("add", "silu_mul", "add_rmsnorm"):
    setattr(lora_fused.SplitLoRA, _name, counted(_name, getattr(lora_fused.SplitLoRA, _name)))


def model_with_adapters(folder: str) -> tuple[ModelRunner, TritonLoRABackend]:
    """The tiny Llama (float16), its first layer on the small-batch kernels (a GEMV for one row, tiles for up to
    32), its second on ``F.linear`` at every size (as ``TREADLE_SMALL_BATCH_MATMUL=library`` loads it), two adapters
    of ranks 8 and 3 in the triton backend's slots (the second leaves k_proj alone)."""
    model_dir = make_tiny_llama(Path(folder) / "base")
    runner = ModelRunner(load_config(overrides=model_config(model_dir, **{"model.dtype": "float16"}),
                                     use_env=False), REGISTRY)
    backend = TritonLoRABackend(2, 8, "cpu", torch.float16)
    gen = torch.Generator().manual_seed(3)
    projections = build_layer_slots(runner.model, backend, 2, 8, torch.device("cpu"), torch.float16)
    with torch.inference_mode():
        _fill(projections, gen)
    for layer in runner.model.model.layers[0].modules():
        if isinstance(layer, LinearBase):  # what a GPU may pick; the CPU picks nothing by itself
            layer.small_batch = small_batch.SmallBatchKernels((GEMV, TILE, TILE))
    return runner, backend


def _fill(projections: dict, gen: torch.Generator) -> None:
    for name, projection in projections.items():
        for slot, rank in enumerate((8, 0 if name.endswith("k_proj") else 3)):
            projection.a[slot, :rank] = (torch.randn(rank, projection.a.shape[2], generator=gen) * 0.3).half()
            projection.b[slot, :, :rank] = (torch.randn(projection.b.shape[1], rank, generator=gen) * 0.3).half()
            projection.scalings[slot], projection.ranks[slot] = 0.5 * (slot + 1), rank


def model_logits(runner: ModelRunner) -> list[torch.Tensor]:
    """A 3-request prefill (rows 1 and 3 with adapters 0 and 1, row 2 none), a 3-request decode step, then a decode
    step of row 1 alone (the one-row GEMV); each step's logits."""
    steps = HandSteps(runner, {1: 0, 3: 1})
    prompt = [5, 17, 42, 8]
    return [steps.extend({1: prompt, 2: prompt, 3: prompt}), steps.decode({1: 3, 2: 3, 3: 3}), steps.decode({1: 9})]


def main(folder: str) -> None:
    results = {f"{layer},{tokens},{config},{choice.name}": kernel_case(layer, tokens, config, choice)
               for layer, tokens, config, choice in KERNEL_CASES}
    runner, backend = model_with_adapters(folder)
    split_runs = {}
    for fuse in (1, 0):
        backend.kernel_choice = dataclasses.replace(backend.kernel_choice, fuse_gemv=fuse, fuse_max_tokens=64)
        calls.clear()
        split_runs[fuse] = (model_logits(runner), dict(calls))
    (fused_logits, fused_calls), (unfused_logits, unfused_calls) = split_runs[1], split_runs[0]
    prefill = unfused_logits[0]
    results["model"] = {"equal": all(torch.equal(p, q) for p, q in zip(fused_logits, unfused_logits)),
                        "split_calls": fused_calls, "unfused_split_calls": unfused_calls,
                        "adapter_effect": min((prefill[3] - prefill[7]).abs().max().item(),
                                              (prefill[11] - prefill[7]).abs().max().item())}
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
