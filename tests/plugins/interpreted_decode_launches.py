"""Run by test_decode_launches.py under TRITON_INTERPRET=1: what one decode step of one token launches on a GPU, for
a tiny float16 Llama in 16 bits and the same shape in W4A16 (compressed-tensors pack-quantized, dummy weights).
The layers take the kernels a GPU picks (the 16-bit one-row GEMV of kernels/small_batch.py, the integer plans of
kernels/int_kernel_plan.py untimed) and the fused ops run their Triton kernels, interpreted. Each Triton launch and
each PyTorch op that runs a kernel (views and allocations do not) is recorded; the Triton kernels are recorded, not
run (``--run`` runs them too, interpreted: slow), so the step's values are garbage and only its launches count.
``[FOLDER] [--rows N] [--run]``: the models' configs go to FOLDER (default a temporary one); ``--rows N``: a
decode step of N requests (default 1). Prints ``LAUNCHES {json}``: per model, the step's launches in
order."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import treadle.kernels.fused_ops as fused_ops  # noqa: E402

fused_ops._use_triton = lambda x: True

from hand_lora import HandSteps, model_config  # noqa: E402
from treadle.bench.shapes import TINY, W4A16_CONFIG, write_config  # noqa: E402
from treadle.core.config import load_config  # noqa: E402
from treadle.core.execution.model_runner import ModelRunner  # noqa: E402
from treadle.core.registry import build_registry  # noqa: E402
from treadle.kernels.int_kernel_plan import plan_kernels  # noqa: E402
from treadle.kernels.small_batch import SIXTEEN_BIT_CONFIGS  # noqa: E402
from treadle.layers import small_batch  # noqa: E402
from treadle.layers.linear import LinearBase, ParallelLMHead  # noqa: E402

GEMV = next(c for c in SIXTEEN_BIT_CONFIGS if c.gemv and c.split_k == 1)
REGISTRY = build_registry(["treadle.plugins.models.llama", "treadle.plugins.attention.torch_native",
                           "treadle.plugins.kv_allocators.token", "treadle.plugins.quantization.compressed_tensors"],
                          load_entry_points=False)
# PyTorch ops that launch nothing on a GPU: views, allocations, metadata.
NO_KERNEL = {"view", "_unsafe_view", "reshape", "_reshape_alias", "empty", "empty_like", "empty_strided", "t",
             "detach", "slice", "select", "as_strided", "unsqueeze", "squeeze", "expand", "permute", "transpose",
             "alias", "split", "split_with_sizes", "chunk", "narrow", "unbind", "lift_fresh", "size",
             "stride", "is_same_size", "sym_size", "sym_stride", "numel", "dim", "new_empty", "_local_scalar_dense"}
launches: list[str] = []
recording = [False]


class Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if recording[0] and name not in NO_KERNEL:
            launches.append(f"aten.{name}")
        return func(*args, **(kwargs or {}))


def _record_triton(execute: bool) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recorded(self, *args, **kwargs):
        was = recording[0]
        if was:
            launches.append(self.fn.__name__)
            if not execute:
                return None
        recording[0] = False  # the interpreter's own tensor work is not the kernel's launches
        try:
            return run(self, *args, **kwargs)
        finally:
            recording[0] = was

    InterpretedFunction.run = recorded


def runner(model_dir: str) -> ModelRunner:
    return ModelRunner(load_config(overrides=model_config(model_dir, **{"model.dtype": "float16",
                                                                      "model.load_format": "dummy",
                                                                      "cache.max_total_tokens": 4096}),
                                   use_env=False), REGISTRY)


def pick_gpu_kernels(model_runner: ModelRunner) -> None:
    """What a GPU picks for one row (the CPU picks nothing): after the prefill, whose tiles' inline PTX the
    interpreter cannot run."""
    for layer in model_runner.model.modules():
        if getattr(layer, "int_kernels", "absent") is None and getattr(layer, "panels", False):
            n, k = layer.weight.shape[0], layer.weight.shape[1] * (32 // layer.bits)
            layer.int_kernels = plan_kernels(n, k, layer.bits, layer.group_size, 4, dtype=torch.float16)
        elif isinstance(layer, (LinearBase, ParallelLMHead)) and getattr(layer, "weight", None) is not None:
            if layer.weight.dtype == torch.float16:
                layer.small_batch = small_batch.SmallBatchKernels((GEMV, None, None))


def step_launches(model_dir: str, rows: int) -> list[str]:
    steps = HandSteps(runner(model_dir))
    steps.extend({row: [5, 17, 42, 8] for row in range(rows)})
    pick_gpu_kernels(steps.runner)
    launches.clear()
    with Ops():
        recording[0] = True
        steps.decode({row: 3 for row in range(rows)})
        recording[0] = False
    return list(launches)


def main(folder: str, execute: bool, rows: int) -> None:
    from treadle.kernels.small_batch import _arrivals

    _record_triton(execute)
    _arrivals(torch.device("cpu"), 1)  # the split-K counters, allocated once (on a GPU while the loader times)
    shapes = {"bf16": TINY, "w4a16": {**TINY, "quantization_config": W4A16_CONFIG}}
    result = {}
    for name, shape in shapes.items():
        model_dir = Path(folder) / name
        model_dir.mkdir(parents=True, exist_ok=True)
        write_config(model_dir, {**shape, "torch_dtype": "float16"})
        result[name] = step_launches(str(model_dir), rows)
    print("LAUNCHES " + json.dumps(result))


if __name__ == "__main__":
    import tempfile

    options = sys.argv[1:]
    rows = int(options[options.index("--rows") + 1]) if "--rows" in options else 1
    with tempfile.TemporaryDirectory() as scratch:
        main(options[0] if options and not options[0].startswith("--") else scratch, "--run" in options, rows)
