"""The engine with the `triton` LoRA backend, its kernels run by Triton's interpreter on the CPU: adapters of two
ranks and the base model mixed in one batch give HF transformers + PEFT's tokens. The prefill (30 tokens) runs the
sorted form (``sort_above=16``: the tokens in the batch context's ``adapter_order``), the decode steps (4 tokens)
the gather kernels. With ``dense_above=1`` every step runs the dense form instead (cuBLAS-style matmuls over every
slot, kernels/lora_dense.py), adapters of ranks 8 and 64. Then the backend's warm-up (every batch size class up to
600 tokens, gather, dense or sorted) runs with the adapters resident and cached, and the same requests give the
same tokens again.

Triton decides interpret-or-compile when first imported, so the engine runs in a fresh subprocess (this file as a
script, TRITON_INTERPRET=1) that prints its outputs; the test compares them with PEFT's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2], [300, 301, 9]]
NAMES = ["r8", None, "big", "big"]
NEW_TOKENS = 5
MARKER = "LORA_ENGINE_JSON="
WARM_TOKENS = 600


def run_engine(base: str, adapters: dict[str, str], max_rank: int) -> list[list]:
    from treadle import Engine

    config = {"model": {"path": base, "device": "cpu", "dtype": "float32"}, "cache": {"max_total_tokens": 512},
              "lora": {"paths": adapters, "backend": "triton", "max_rank": max_rank},
              "plugins": ["treadle.plugins.lora_backends.triton"]}
    with Engine(config) as engine:
        def generate() -> list:
            return engine.generate(input_ids=[PROMPTS[i % 2] for i in range(len(NAMES))], lora_path=NAMES,
                                   sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0.0,
                                                    "ignore_eos": True})

        first = generate()
        # The warm-up (each batch size class of up to WARM_TOKENS) with the adapters resident in their slots and
        # their prefixes cached; the interpreter compiles nothing, so the engine skipped it at start: run it now.
        lora = engine.scheduler.worker.runner.lora
        lora.backend.compiles = True
        lora.warm_up(WARM_TOKENS)
        again = generate()
        return [[o.token_ids for o in first], [o.token_ids for o in again], [o.cached_tokens for o in again]]


@pytest.mark.slow
def test_triton_backend_in_the_engine_matches_peft(tiny_llama_dir, tmp_path):
    _check_engine_against_peft(tiny_llama_dir, tmp_path, 32, "sort_above=16")


def test_dense_form_in_the_engine_matches_peft(tiny_llama_dir, tmp_path):
    """Every step (the 30-token prefill, the 4-token decodes) through the dense form, ranks 8 and 64 mixed."""
    _check_engine_against_peft(tiny_llama_dir, tmp_path, 64, "dense_above=1")


def _check_engine_against_peft(tiny_llama_dir: str, tmp_path, big_rank: int, kernels: str) -> None:
    pytest.importorskip("triton")
    from peft_adapters import ALL_PROJECTIONS, make_peft_adapter, peft_greedy  # tests/ is on the path under pytest

    adapters = {"r8": make_peft_adapter(tiny_llama_dir, tmp_path / "r8", rank=8, targets=ALL_PROJECTIONS),
                "big": make_peft_adapter(tiny_llama_dir, tmp_path / "big", rank=big_rank, seed=4, std=0.05)}
    expected = {name: peft_greedy(tiny_llama_dir, path, PROMPTS, NEW_TOKENS) for name, path in adapters.items()}
    expected[None] = peft_greedy(tiny_llama_dir, None, PROMPTS, NEW_TOKENS)
    result = subprocess.run([sys.executable, __file__, tiny_llama_dir, json.dumps(adapters), str(big_rank)],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TRITON_INTERPRET": "1", "TREADLE_LORA_KERNELS": kernels})
    lines = [line for line in result.stdout.splitlines() if line.startswith(MARKER)]
    assert lines, result.stdout[-2000:] + result.stderr[-4000:]
    outputs, after_warm_up, cached = json.loads(lines[-1].removeprefix(MARKER))
    assert outputs == [expected[name][i % 2] for i, name in enumerate(NAMES)]
    # Warming the kernels up changed no adapter slot and no cached KV: the same tokens, from the cached prefixes.
    assert after_warm_up == outputs and min(cached) > 0
    assert len({tuple(expected[name][0]) for name in expected}) == 3  # the adapters change the greedy tokens


if __name__ == "__main__":
    print(MARKER + json.dumps(run_engine(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))))
