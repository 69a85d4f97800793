"""Which quantization a model gets: model.quantization, the checkpoint's quantization_config, the device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from treadle.core.loading import quantization
from treadle.core.loading.quantization import QuantizationConfig, QuantizationError, gpu_fp8_unsupported, resolve_quantization

CPU = torch.device("cpu")


def _hf(**quantization_config) -> SimpleNamespace:
    return SimpleNamespace(quantization_config=quantization_config or None)


def test_nothing_requested_nothing_stored_is_unquantized():
    assert resolve_quantization(None, _hf(), CPU) is None


def test_requested_fp8_quantizes_at_load_with_dynamic_activations():
    assert resolve_quantization("fp8", _hf(), CPU) == QuantizationConfig()


def test_the_lm_head_is_quantized_only_when_asked_and_only_with_fp8_weights():
    assert not resolve_quantization("fp8", _hf(), CPU).lm_head
    assert resolve_quantization("fp8", _hf(), CPU, lm_head=True) == QuantizationConfig(lm_head=True)
    stored = resolve_quantization(None, _hf(quant_method="fp8"), CPU, lm_head=True)
    assert stored.lm_head and stored.checkpoint_quantized
    with pytest.raises(QuantizationError, match="quantize_lm_head needs FP8 weights"):
        resolve_quantization(None, _hf(), CPU, lm_head=True)


def test_fp8_checkpoint_is_detected_without_the_option():
    config = resolve_quantization(None, _hf(quant_method="fp8", activation_scheme="static",
                                            ignored_layers=["model.layers.0.mlp.down_proj"]), CPU)
    assert config.checkpoint_quantized and config.activation_scheme == "static" and not config.dequantize
    assert config.is_ignored("model.layers.0.mlp.down_proj")
    assert not config.is_ignored("model.layers.1.mlp.down_proj")


def test_ignored_parts_of_a_merged_layer_must_all_be_listed():
    config = QuantizationConfig(ignored_layers=("m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.k_proj",
                                                "m.layers.0.self_attn.v_proj", "m.layers.1.self_attn.q_proj"))
    assert config.is_ignored("m.layers.0.self_attn.qkv_proj")
    with pytest.raises(QuantizationError, match="all be quantized or all be ignored"):
        config.is_ignored("m.layers.1.self_attn.qkv_proj")


@pytest.mark.parametrize("stored, message", [
    (dict(quant_method="gptq", bits=4), "quant_method 'gptq'.*supported: fp8"),
    (dict(quant_method="fp8", weight_block_size=[128, 128]), "block-wise FP8"),
    (dict(quant_method="fp8", activation_scheme="per_group"), "activation_scheme 'per_group'"),
])
def test_checkpoints_treadle_cannot_load_are_named(stored, message):
    with pytest.raises(QuantizationError, match=message):
        resolve_quantization(None, _hf(**stored), CPU)


def test_gpus_without_fp8_tensor_cores_are_named():
    assert gpu_fp8_unsupported("NVIDIA H100 80GB HBM3", (9, 0)) is None
    assert gpu_fp8_unsupported("NVIDIA L4", (8, 9)) is None
    reason = gpu_fp8_unsupported("NVIDIA A100-SXM4-80GB", (8, 0))
    assert "compute capability 8.9 or newer" in reason and "A100" in reason and "is 8.0" in reason


def test_quantizing_on_a_gpu_without_fp8_is_refused_and_checkpoints_dequantize(monkeypatch):
    reason = gpu_fp8_unsupported("NVIDIA A100-SXM4-80GB", (8, 0))
    monkeypatch.setattr(quantization, "fp8_matmul_unsupported", lambda device: reason)
    with pytest.raises(QuantizationError) as info:
        resolve_quantization("fp8", _hf(), CPU)
    assert str(info.value).startswith("model.quantization: fp8 needs FP8 tensor cores (compute capability 8.9")
    assert "leave model.quantization empty" in str(info.value)
    config = resolve_quantization(None, _hf(quant_method="fp8"), CPU)
    assert config.checkpoint_quantized and config.dequantize


def test_this_torch_runs_fp8_matmuls_on_the_cpu():
    # The CPU tests of the FP8 linear layers rely on it; torch >= 2.6 CPU builds have it.
    assert quantization.fp8_matmul_unsupported("cpu") is None
