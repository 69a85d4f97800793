"""The other built-in model families split over tensor-parallel ranks: tp=2 (gloo, CPU) generates what tp=1
does, from a checkpoint each rank reads only its slices of. Qwen2 covers biased q/k/v; Qwen3-MoE covers
per-head q/k norms and experts split along their intermediate dim (Mixtral shares that MoE block; Llama and
Mistral are in tests/core/test_tensor_parallel.py). One process group per case, so only two cases."""

from __future__ import annotations

import pytest

from treadle.testing import check_tensor_parallel
from treadle.testing.models import make_tiny_qwen2, make_tiny_qwen3_moe


@pytest.mark.parametrize("make", [make_tiny_qwen2, make_tiny_qwen3_moe], ids=["qwen2", "qwen3_moe"])
def test_model_family_matches_tp1_at_tp2(tmp_path, make):
    tokens = check_tensor_parallel(make(tmp_path / "model"), tp_size=2)
    assert len({tuple(ids) for ids in tokens}) > 1  # distinct prompts, distinct continuations
