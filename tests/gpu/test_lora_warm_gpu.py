"""The LoRA kernels warmed up at engine start (issue 50): after an engine with an adapter has started (default graph
and chunk sizes: decode graphs, piecewise prefill graphs up to 1024 tokens, 4096-token offline chunks), a 3000-token
prefill with the adapter and a mixed extend step of several prompt lengths compile no LoRA kernel: the counts of
compiled variants in Triton's in-memory caches of every kernel in kernels/lora*.py are unchanged. A kernel choice
whose sorted expand takes another constexpr then does compile at the next long prefill (the count can move).

Run on the device machine: ``python -m pytest -q -s tests/gpu/test_lora_warm_gpu.py`` (``-s`` prints the warm-up's
log line: its batches and seconds).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import pytest

from peft_adapters import ALL_PROJECTIONS, make_peft_adapter
from treadle import Engine

pytestmark = pytest.mark.gpu

GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def lora_compiles() -> dict[str, int]:
    """Each LoRA kernel's count of compiled variants (over devices) in Triton's in-memory cache."""
    from triton.runtime.jit import JITFunction

    from treadle.kernels import lora, lora_dense, lora_fused, lora_sorted, lora_tiles

    counts = {}
    for module in (lora, lora_dense, lora_fused, lora_sorted, lora_tiles):
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                caches = getattr(value, "device_caches", None)
                if caches is not None:  # triton 3.2+: device -> (kernel cache, ...)
                    counts[f"{module.__name__}.{name}"] = sum(len(entry[0]) for entry in caches.values())
                else:
                    counts[f"{module.__name__}.{name}"] = sum(len(cache) for cache in value.cache.values())
    return counts


def test_long_prefill_with_an_adapter_compiles_no_lora_kernel(real_shape_llama_dir, tmp_path, caplog):
    adapter = make_peft_adapter(real_shape_llama_dir, tmp_path / "all16", rank=16, targets=ALL_PROJECTIONS, std=0.03)
    config = {"model": {"path": real_shape_llama_dir, "dtype": "bfloat16", "device": "cuda", "context_length": 4096},
              "cache": {"max_total_tokens": 16384}, "scheduler": {"max_running_requests": 32},
              "lora": {"paths": {"all16": adapter}},
              "plugins": ["treadle.plugins.lora_backends.torch", "treadle.plugins.lora_backends.triton"]}
    rng = random.Random(0)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(10, 8000) for _ in range(length)]

    with caplog.at_level(logging.INFO, logger="treadle.core.lora.manager"), Engine(config) as engine:
        warmed = [r.getMessage() for r in caplog.records if "LoRA kernels warmed up" in r.getMessage()]
        print("\n" + "\n".join(warmed))
        assert len(warmed) == 1 and "batches of 1 to 4096 tokens" in warmed[0]
        compiled = lora_compiles()
        assert sum(compiled.values()) > 0
        start = time.perf_counter()
        engine.generate(input_ids=[prompt(3000)], lora_path="all16", sampling_params=GREEDY)
        print(f"the first 3000-token prefill with the adapter, 3 decode steps: {time.perf_counter() - start:.3f} s")
        # One extend step of 2610 tokens over two adapters' prompts and the base model's, then their decode steps.
        engine.generate(input_ids=[prompt(n) for n in (1500, 700, 300, 90, 20)],
                        lora_path=["all16", None, "all16", "all16", None], sampling_params=GREEDY)
        after = lora_compiles()
        assert after == compiled, {name: (compiled[name], count) for name, count in after.items()
                                   if count != compiled[name]}

        # The count moves when a launch needs a variant not compiled yet: the sorted expand's column groups of 3.
        backend = engine.scheduler.worker.runner.lora.backend
        backend.kernel_choice = dataclasses.replace(backend.kernel_choice, sort_columns=384)
        start = time.perf_counter()
        engine.generate(input_ids=[prompt(3000)], lora_path="all16", sampling_params=GREEDY)
        print(f"the same with a sorted expand not compiled yet: {time.perf_counter() - start:.3f} s")
        assert sum(lora_compiles().values()) > sum(compiled.values())
