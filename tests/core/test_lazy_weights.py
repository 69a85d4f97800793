"""Quantizing at load one layer at a time: a 16-bit checkpoint loaded with ``model.quantization: fp8`` never holds
more than the layers being loaded in 16 bits (core/loading/lazy_weights.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from treadle.core.loading import model_loader
from treadle.core.config import ModelConfig
from treadle.core.loading.model_loader import ModelLoadError, load_model
from treadle.core.loading.quantization import FP8_DTYPE
from treadle.core.registry import build_registry
from treadle.plugins.models.llama import LlamaForCausalLM
from treadle.layers.moe import FusedExperts
from treadle.testing.models import make_tiny_llama, make_tiny_mixtral

LAYERS = 4


@pytest.fixture(scope="module")
def registry():
    return build_registry(plugin_modules=["treadle.plugins.models.llama", "treadle.plugins.models.mixtral",
                                          "treadle.plugins.attention.torch_native"], load_entry_points=False)


def _quantized_weights(model) -> list[torch.Tensor]:
    """The weights ``model.quantization: fp8`` quantizes at load: the decoder's projections and the experts."""
    weights = []
    for module in model.modules():
        if type(module.quant_method if hasattr(module, "quant_method") else None).__name__ == "Fp8LinearMethod":
            weights.append(module.weight)
        if isinstance(module, FusedExperts):
            weights += [module.gate_up_proj, module.down_proj]
    return weights


def _census(model) -> tuple[int, int, int]:
    """(weights not loaded yet, weights that hold memory in 16 bits (32 in these tests), FP8 weights). The 16-bit
    ones are counted among every parameter created to be quantized at load, wherever it is still referred to
    (the loader's lists too), by the memory it holds."""
    weights = _quantized_weights(model)
    waiting = sum(w.is_meta for w in weights)
    fp8 = sum(w.dtype == FP8_DTYPE for w in weights)
    holding = sum(1 for obj in gc.get_objects()
                  if type(obj) is torch.nn.Parameter and hasattr(obj, "materialize_on") and not obj.is_meta
                  and obj.untyped_storage().nbytes() > 0)
    return waiting, holding, fp8


def test_a_checkpoint_is_quantized_layer_by_layer_as_it_loads(tmp_path, registry, monkeypatch):
    path = make_tiny_llama(tmp_path / "llama", num_hidden_layers=LAYERS)
    seen: list[tuple[int, int, int]] = []
    load_weights = LlamaForCausalLM.load_weights

    def watched(self, weights):
        def each():
            for item in weights:
                seen.append(_census(self))
                yield item
        load_weights(self, each())

    monkeypatch.setattr(LlamaForCausalLM, "load_weights", watched)
    model, _, _ = load_model(ModelConfig(path=path, device="cpu", dtype="float32", quantization="fp8"), registry)
    assert seen[0] == (4 * LAYERS, 0, 0)  # nothing takes memory before its tensors arrive
    # At most a merged projection waiting for its last part and the layer just loaded exist in 16 bits at once ...
    assert max(loaded for _, loaded, _ in seen) <= 2
    # ... while earlier layers are FP8 already and later ones not loaded yet.
    assert any(waiting and fp8 for waiting, _, fp8 in seen)
    assert _census(model) == (0, 0, 4 * LAYERS)


def test_the_same_weights_result_as_quantizing_the_whole_16_bit_model(tmp_path, registry):
    from treadle.core.loading.lazy_weights import finish_module

    path = make_tiny_llama(tmp_path / "llama", num_hidden_layers=2)
    streamed, _, _ = load_model(ModelConfig(path=path, device="cpu", dtype="float32", quantization="fp8"), registry)
    plain, _, _ = load_model(ModelConfig(path=path, device="cpu", dtype="float32"), registry)
    for name, module in plain.named_modules():
        if hasattr(module, "quant_method") and hasattr(module, "weight") and name.startswith("model.layers"):
            reference = streamed.get_submodule(name)
            module.quant_method = reference.quant_method
            module.weights_finished = False
            finish_module(module)  # quantize the fully loaded 16-bit weight, as before this change
            assert torch.equal(module.weight.view(torch.uint8), reference.weight.view(torch.uint8)), name
            assert torch.equal(module.weight_scale, reference.weight_scale), name


def test_dummy_weights_of_an_moe_are_quantized_one_layer_at_a_time(tmp_path, registry, monkeypatch):
    path = make_tiny_mixtral(tmp_path / "mixtral", num_hidden_layers=LAYERS)
    seen: list[tuple[int, int, int]] = []
    holder = {}
    fill, fill_one = model_loader.fill_dummy_weights, model_loader._fill_dummy

    def fill_watched(model, seed):
        holder["model"] = model
        fill(model, seed)

    def fill_one_watched(param, *args):
        seen.append(_census(holder["model"]))
        fill_one(param, *args)

    monkeypatch.setattr(model_loader, "fill_dummy_weights", fill_watched)
    monkeypatch.setattr(model_loader, "_fill_dummy", fill_one_watched)
    config = ModelConfig(path=path, device="cpu", dtype="float32", quantization="fp8", load_format="dummy")
    model, _, _ = load_model(config, registry)
    per_layer = 2 + 2  # qkv and o; the experts' gate_up and down
    assert seen[0] == (per_layer * LAYERS, 0, 0)
    assert max(loaded for _, loaded, _ in seen) <= 2
    assert _census(model) == (0, 0, per_layer * LAYERS)


def test_a_loader_that_fills_nothing_is_refused_by_name(tmp_path, registry, monkeypatch):
    path = make_tiny_llama(tmp_path / "llama", num_hidden_layers=1)
    monkeypatch.setattr(LlamaForCausalLM, "load_weights", lambda self, weights: None)
    with pytest.raises(ModelLoadError, match=r"nothing was loaded into model\.layers\.0\.self_attn\.qkv_proj\.weight"):
        load_model(ModelConfig(path=path, device="cpu", dtype="float32", quantization="fp8"), registry)
