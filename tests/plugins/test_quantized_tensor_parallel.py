"""Quantized checkpoints split over tp=2 ranks (gloo, CPU) generate what tp=1 does: packed weights, group scales and
zero points sharded along the output (q/k/v by heads, gate/up) and along the input in whole groups (o_proj,
down_proj), and GPTQ act-order's g_idx split with the input while every rank keeps all groups' scales."""

from __future__ import annotations

from treadle.testing import check_tensor_parallel
from treadle.testing.quantized_models import make_tiny_quantized

QUANTIZATION_PLUGINS = [f"treadle.plugins.quantization.{name}" for name in ("gptq", "awq", "compressed_tensors")]


def test_act_order_gptq_llama_matches_tp1_at_tp2(tmp_path):
    # Asymmetric, so the zero points (packed along the output) are split too.
    quantized, _ = make_tiny_quantized(tmp_path, "gptq", act_order=True, sym=False)
    tokens = check_tensor_parallel(quantized, tp_size=2, overrides={"plugins": QUANTIZATION_PLUGINS})
    assert len({tuple(ids) for ids in tokens}) > 1
