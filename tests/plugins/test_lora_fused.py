"""The LoRA delta split around the small-batch matmul (kernels/lora_fused.py: two launches a layer at decode sizes)
gives the unfused triton path's results bit for bit, on the CPU under Triton's interpreter.

Triton decides interpret-or-compile when it is first imported, so the checks run in one fresh subprocess
(interpreted_lora_fused.py) and the tests assert on its results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    pytest.importorskip("triton")
    script = Path(__file__).with_name("interpreted_lora_fused.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path_factory.mktemp("lora-fused"))],
                          capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))[8:])


def test_split_kernels_equal_the_unfused_path_bit_for_bit(results):
    kernels = {name: result for name, result in results.items() if name != "model"}
    assert len(kernels) == 10
    for name, result in kernels.items():
        assert result["equal"], name
        assert result["delta"] > 0.5, name  # the adapters change the layer's output: a dropped delta could not pass


def test_a_model_splits_every_layer_with_the_unfused_logits(results):
    """The first layer on the small-batch kernels (two launches a layer), the second on F.linear
    (TREADLE_SMALL_BATCH_MATMUL=library: the shrink apart), both expands carrying the layer's epilogue."""
    model = results["model"]
    assert model["equal"]
    assert model["adapter_effect"] > 0.5
    # 3 steps of 2 layers: qkv and the last down_proj add, o_proj and the first down_proj add + RMSNorm, gate_up
    # SiLU·mul; with fuse_gemv=0 nothing splits
    assert model["split_calls"] == {"add": 9, "add_rmsnorm": 9, "silu_mul": 6}
    assert model["unfused_split_calls"] == {}
