"""Quantized checkpoints on the CPU (torch reference path): GPTQ, AWQ and compressed-tensors give HF transformers'
logits on the same dequantized weights and its greedy tokens; the method comes from the checkpoint or is named;
checkpoints treadle cannot run are refused at load naming the method and what is supported.

The checkpoints are written by ``treadle.testing.quantized_models``: compressed-tensors ones by the
``compressed-tensors`` package itself, GPTQ and AWQ from their published layouts (documented there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from prefill_logits import prefill_logits
from treadle.core.config import ModelConfig
from treadle.core.engine import Engine
from treadle.core.loading.model_loader import ModelLoadError, load_model
from treadle.core.registry import build_registry
from treadle.testing import check_quantization_method
from treadle.testing.models import make_tiny_qwen3
from treadle.testing.quantized_models import make_tiny_quantized, quantized_tensors

QUANTIZATION_PLUGINS = [f"treadle.plugins.quantization.{name}" for name in ("fp8", "gptq", "awq", "compressed_tensors")]
PLUGINS = ["treadle.plugins.models.llama", "treadle.plugins.models.qwen3", "treadle.plugins.models.mixtral",
           "treadle.plugins.models.qwen3_moe",
           "treadle.plugins.attention.torch_native", *QUANTIZATION_PLUGINS]
TOKENS = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 128, 9]

CASES = {
    "gptq-4bit-sym": ("gptq", {}),
    "gptq-4bit-act-order-asym": ("gptq", dict(act_order=True, sym=False)),
    "gptq-8bit": ("gptq", dict(bits=8, group_size=64)),
    "awq-4bit-g32": ("awq", {}),
    "awq-4bit-g64": ("awq", dict(group_size=64)),
    "ct-w4a16-sym": ("compressed-tensors", {}),
    "ct-w4a16-asym": ("compressed-tensors", dict(sym=False, group_size=64)),
    "ct-w8a16-channel": ("compressed-tensors", dict(bits=8, group_size=-1)),
    "ct-w8a16-int-quantized": ("compressed-tensors", dict(bits=8, group_size=-1, fmt="int-quantized")),
}


@pytest.fixture(scope="module")
def registry():
    return build_registry(plugin_modules=PLUGINS, load_entry_points=False)


def _prefill_logits(model_dir: str, registry) -> torch.Tensor:
    model, _, _ = load_model(ModelConfig(path=model_dir, device="cpu", dtype="float32"), registry)
    return prefill_logits(model, TOKENS)


def _hf_logits(model_dir: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0]


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_llama_logits_equal_hf_on_the_dequantized_weights(tmp_path, registry, case):
    method, settings = CASES[case]
    quantized, dequantized = make_tiny_quantized(tmp_path, method, **settings)
    got, expected = _prefill_logits(quantized, registry), _hf_logits(dequantized)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4), (got - expected).abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("method, settings", [("gptq", dict(act_order=True)), ("awq", {}),
                                              ("compressed-tensors", dict(sym=False))])
def test_quantized_qwen3_greedy_tokens_equal_hf(tmp_path, method, settings):
    from transformers import AutoModelForCausalLM

    quantized, dequantized = make_tiny_quantized(tmp_path, method, make_tiny_qwen3, **settings)
    hf = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([TOKENS]), max_new_tokens=8, do_sample=False)[0, len(TOKENS):].tolist()
    config = {"model": {"path": quantized, "device": "cpu", "dtype": "float32"}, "plugins": QUANTIZATION_PLUGINS,
              "cache": {"max_total_tokens": 512}}
    with Engine(config) as engine:
        out = engine.generate(input_ids=[TOKENS], sampling_params={"max_new_tokens": 8, "temperature": 0.0,
                                                                     "ignore_eos": True})
    assert out[0].token_ids == expected


def test_compressed_tensors_fp8_runs_through_the_fp8_layers(tmp_path, registry):
    quantized, dequantized = make_tiny_quantized(tmp_path, "compressed-tensors", fmt="float-quantized")
    model, _, _ = load_model(ModelConfig(path=quantized, device="cpu", dtype="float32"), registry)
    assert model.model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    got, expected = _prefill_logits(quantized, registry), _hf_logits(dequantized)
    # The activations are quantized to FP8 per token (W8A8): close to, not equal to, the dequantized weights' logits.
    assert ((got - expected).norm() / expected.norm()).item() < 0.1  # about 0.07


def test_the_method_is_detected_from_the_checkpoint_and_can_be_named(tmp_path, registry):
    quantized, _ = make_tiny_quantized(tmp_path, "awq")
    for requested in (None, "auto", "awq"):
        model, _, _ = load_model(ModelConfig(path=quantized, device="cpu", dtype="float32", quantization=requested),
                                 registry)
        layer = model.model.layers[1].self_attn.qkv_proj
        assert layer.weight.dtype == torch.int32 and layer.bits == 4 and layer.weight_zeros is not None
    with pytest.raises(ModelLoadError, match="gptq needs a checkpoint whose quantization_config has quant_method gptq"):
        load_model(ModelConfig(path=quantized, device="cpu", quantization="gptq"), registry)
    with pytest.raises(ModelLoadError, match="'marlin' is not a registered quantization method; available: awq"):
        load_model(ModelConfig(path=quantized, device="cpu", quantization="marlin"), registry)


def test_registered_methods_are_listed_and_checked_at_startup():
    from treadle.core.config import ConfigError, load_config, validate_plugin_choices

    registry = build_registry(plugin_modules=QUANTIZATION_PLUGINS)  # every installed plugin, and these
    assert set(registry.table()["quantization_methods"]) >= {"fp8", "gptq", "awq", "compressed-tensors"}
    validate_plugin_choices(load_config(overrides={"model.quantization": "awq"}, use_env=False), registry)
    with pytest.raises(ConfigError, match="model.quantization: unknown quantization method 'marlin'; available: awq"):
        validate_plugin_choices(load_config(overrides={"model.quantization": "marlin"}, use_env=False), registry)


def _rewrite(folder: str, config_change=None, drop: str | None = None) -> None:
    path = Path(folder)
    if config_change:
        config = json.loads((path / "config.json").read_text())
        config_change(config["quantization_config"])
        (path / "config.json").write_text(json.dumps(config))
    if drop:
        tensors = load_file(str(path / "model.safetensors"))
        save_file({k: v for k, v in tensors.items() if not k.endswith(drop)}, str(path / "model.safetensors"))


@pytest.mark.parametrize("change, drop, message", [
    (lambda q: q.update(quant_method="bitsandbytes"), None,
     "quant_method 'bitsandbytes', which no registered quantization method reads; supported: .*awq: AWQ 4-bit"),
    (lambda q: q.update(bits=3), None, "3-bit weights; supported: GPTQ 4-bit and 8-bit"),
    (lambda q: q.update(bits=8), None, "has shape .* but the model expects"),
    (None, ".scales", "tensors missing from the checkpoint .*scales"),
])
def test_bad_checkpoints_are_refused_at_load(tmp_path, registry, change, drop, message):
    quantized, _ = make_tiny_quantized(tmp_path, "gptq")
    _rewrite(quantized, change, drop)
    with pytest.raises(Exception, match=message):
        load_model(ModelConfig(path=quantized, device="cpu", dtype="float32"), registry)


@pytest.mark.parametrize("family, method, experts", [("mixtral", "gptq", False), ("mixtral", "gptq", True),
                                                     ("mixtral", "compressed-tensors", True),
                                                     ("qwen3_moe", "awq", True)])
def test_quantized_moe_logits_equal_hf(tmp_path, registry, family, method, experts):
    from treadle.testing import models

    # Attention quantized, experts 16-bit; or the experts quantized too: kept packed by the fused experts (their
    # torch path dequantizes each as it runs) where the shapes are whole groups (Qwen3-MoE's 48 are not: dequantized).
    make = getattr(models, f"make_tiny_{family}")
    quantized, dequantized = make_tiny_quantized(tmp_path, method, make, experts=experts)
    model, _, _ = load_model(ModelConfig(path=quantized, device="cpu", dtype="float32"), registry)
    fused = model.model.layers[0].mlp.experts
    assert (fused.gate_up_proj.dtype == torch.int32) == (experts and family == "mixtral")
    got, expected = prefill_logits(model, TOKENS), _hf_logits(dequantized)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4), (got - expected).abs().max()


def test_dequantized_experts_become_fp8_where_the_device_multiplies_fp8(tmp_path, registry, monkeypatch):
    from treadle.layers import packed_int
    from treadle.testing.models import make_tiny_mixtral

    monkeypatch.setattr(packed_int, "experts_in_fp8", lambda device: True)  # as on an H100
    # Act-order experts (a permutation of the input per expert) cannot stay packed: dequantized, then FP8.
    quantized, dequantized = make_tiny_quantized(tmp_path, "gptq", make_tiny_mixtral, act_order=True)
    model, _, _ = load_model(ModelConfig(path=quantized, device="cpu", dtype="float32"), registry)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.down_scale is not None
    got, expected = prefill_logits(model, TOKENS), _hf_logits(dequantized)
    assert ((got - expected).norm() / expected.norm()).item() < 0.1


@pytest.mark.parametrize("method, settings", [("gptq", dict(act_order=True, sym=False)), ("gptq", dict(bits=8)),
                                              ("awq", dict(group_size=64)), ("compressed-tensors", dict(sym=False))])
def test_built_in_methods_pass_the_conformance_check(method, settings):
    from treadle.plugins.quantization.awq import AwqMethod
    from treadle.plugins.quantization.compressed_tensors import CompressedTensorsMethod
    from treadle.plugins.quantization.gptq import GptqMethod

    factory = {"gptq": GptqMethod, "awq": AwqMethod, "compressed-tensors": CompressedTensorsMethod}[method]
    config = quantized_tensors(method, torch.randn(64, 128), **settings)[2]
    check_quantization_method(factory, config, lambda weight: quantized_tensors(method, weight, **settings)[:2])


def test_an_integer_model_takes_the_fp8_lm_head_with_its_best_logits_exact(tmp_path, registry):
    from treadle.layers.fp8 import Fp8LmHeadMethod

    quantized, dequantized = make_tiny_quantized(tmp_path, "gptq")
    sixteen_bit, _, _ = load_model(ModelConfig(path=quantized, device="cpu", dtype="float32"), registry)
    assert sixteen_bit.lm_head.weight.dtype == torch.float32  # auto: FP8 on GPUs only, the CPU keeps parity
    model, _, _ = load_model(ModelConfig(path=quantized, device="cpu", dtype="float32", quantize_lm_head=True),
                             registry)
    assert isinstance(model.lm_head.quant_method, Fp8LmHeadMethod)
    assert model.lm_head.weight.dtype == torch.float8_e4m3fn and model.lm_head.exact_weight is not None
    got, expected = prefill_logits(model, TOKENS), _hf_logits(dequantized)
    # Each row's 8 best FP8 logits are recomputed from the 16-bit weight: the best one is HF's, exactly.
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert torch.allclose(got.max(-1).values, expected.max(-1).values, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, expected, rtol=1e-4, atol=1e-4)  # the rest are FP8's


def test_integer_models_choose_the_fp8_head_on_gpus_that_multiply_fp8(monkeypatch):
    from treadle.core.loading.quantization import QuantizationError
    from treadle.layers import packed_int

    monkeypatch.setattr(packed_int, "fp8_matmul_unsupported", lambda device: None)  # as on an H100
    assert packed_int.fp8_lm_head("auto", torch.device("cuda")) == "auto"
    assert packed_int.fp8_lm_head("auto", torch.device("cpu")) is False
    assert packed_int.fp8_lm_head(False, torch.device("cuda")) is False
    monkeypatch.setattr(packed_int, "fp8_matmul_unsupported", lambda device: "is an A100 (compute capability 8.0)")
    assert packed_int.fp8_lm_head("auto", torch.device("cuda")) is False
    with pytest.raises(QuantizationError, match="quantize_lm_head: true needs FP8 matmuls and this device is an A100"):
        packed_int.fp8_lm_head(True, torch.device("cuda"))
