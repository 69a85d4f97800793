"""Run by test_output_deltas.py in a subprocess under TRITON_INTERPRET=1: a tiny float16 Llama whose linear layers
run the one-row GEMV of kernels/small_batch.py (with its fused silu_mul and add_rmsnorm epilogues), with the hand
LoRA's deltas, against the merged checkpoints through the same kernels. Prints one ``RESULTS {json}`` line."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hand_lora import HandLora, HandSteps, model_config  # noqa: E402
from treadle.core.config import load_config  # noqa: E402
from treadle.core.execution.model_runner import ModelRunner  # noqa: E402
from treadle.core.registry import build_registry  # noqa: E402
from treadle.kernels.small_batch import SIXTEEN_BIT_CONFIGS  # noqa: E402
from treadle.layers import small_batch  # noqa: E402
from treadle.layers.linear import LinearBase  # noqa: E402
from treadle.testing.models import make_tiny_llama  # noqa: E402

GEMV = next(c for c in SIXTEEN_BIT_CONFIGS if c.gemv and c.split_k == 1)
# One prompt for every request row: row 2's logits (no adapter) are then what the adapters move away from.
PROMPT = [5, 17, 42, 8]
ADAPTERS = {1: 0, 3: 1}
DECODED = [3]
REGISTRY = build_registry(["treadle.plugins.models.llama", "treadle.plugins.attention.torch_native",
                           "treadle.plugins.kv_allocators.token"], load_entry_points=False)
fused = Counter()


def counted(name, function):
    def run(*args, **kwargs):
        result = function(*args, **kwargs)
        fused[name] += result is not None
        return result
    return run


small_batch.silu_mul_matmul = counted("silu_mul", small_batch.silu_mul_matmul)
small_batch.add_rmsnorm_matmul = counted("add_rmsnorm", small_batch.add_rmsnorm_matmul)


def runner(model_dir: str) -> ModelRunner:
    model_runner = ModelRunner(load_config(overrides=model_config(model_dir, **{"model.dtype": "float16"}),
                                           use_env=False), REGISTRY)
    for layer in model_runner.model.modules():
        if isinstance(layer, LinearBase):  # what a GPU picks for one row; the CPU picks nothing by itself
            layer.small_batch = small_batch.SmallBatchKernels((GEMV, None, None))
    return model_runner


def decode_logits(steps: HandSteps, row: int) -> torch.Tensor:
    """A one-request decode after its prompt: each step's logits (one row, so the GEMV and its epilogues run)."""
    steps.extend({row: PROMPT})
    return torch.cat([steps.decode({row: token}) for token in DECODED])


def main(folder: str) -> None:
    lora = HandLora(make_tiny_llama(Path(folder) / "base"))
    with_deltas = runner(lora.model_dir)
    lora.register(with_deltas.model)
    expected, got, fused_calls = {}, {}, {}
    for row in (1, 2, 3):
        adapter = ADAPTERS.get(row)
        reference_dir = lora.model_dir if adapter is None else lora.merged_checkpoint(adapter, Path(folder) / f"{row}")
        fused.clear()
        expected[row] = decode_logits(HandSteps(runner(reference_dir)), row)
        fused_calls[f"reference {row}"] = dict(fused)
        fused.clear()
        got[row] = decode_logits(HandSteps(with_deltas, ADAPTERS), row)
        fused_calls[f"with deltas {row}"] = dict(fused)
    results = {"fused_calls": fused_calls}
    for row in expected:
        results[str(row)] = {"error": (got[row] - expected[row]).abs().max().item(),
                             "adapter_effect": (expected[row] - expected[2]).abs().max().item()}
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
