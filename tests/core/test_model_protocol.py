"""The model interface (core/execution/model_protocol.py): the members every model has, the optional ones read with
their defaults through ModelTraits, what the built-in families declare, and the loader and runner acting on them."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from treadle.core.config import load_config
from treadle.core.execution.model_protocol import CausalLM, ModelTraits, SplitForwardModel, accepts_quant_config
from treadle.core.execution.model_runner import ModelRunner
from treadle.core.hookspecs import hookimpl
from treadle.core.registry import build_registry
from treadle.plugins.models.llama import LlamaForCausalLM
from treadle.plugins.models.mixtral import MixtralForCausalLM
from treadle.plugins.models.qwen3_moe import Qwen3MoeForCausalLM
from treadle.testing.models import TINY_LLAMA_CONFIG, make_tiny_llama


class BareModel(torch.nn.Module):
    """A third-party model with the required members only."""

    def __init__(self, config) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, input_ids, positions, forward_batch):
        return self.proj(torch.zeros(len(input_ids), 4))

    def load_weights(self, weights) -> None:
        for _ in weights:
            pass


def test_a_model_without_optional_members_gets_the_defaults():
    model = BareModel(None)
    assert isinstance(model, CausalLM) and not isinstance(model, SplitForwardModel)
    assert ModelTraits.of(model) == ModelTraits()
    assert ModelTraits() == ModelTraits(launch_bound_prefill=False, prefers_mixed_chunks=False, kv_cache_scales={},
                                        weights_loaded=None, splits_forward=False)
    assert not accepts_quant_config(BareModel)


def test_the_built_in_families_declare_their_traits():
    llama = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_CONFIG))
    traits = ModelTraits.of(llama)
    assert isinstance(llama, CausalLM) and traits.splits_forward and accepts_quant_config(LlamaForCausalLM)
    assert not traits.launch_bound_prefill and not traits.prefers_mixed_chunks and traits.kv_cache_scales == {}
    assert traits.weights_loaded == llama.weights_loaded
    # The mixtures of experts: decode steps read what prefill chunks read; Qwen3-MoE's prefill is launch-bound.
    assert MixtralForCausalLM.prefers_mixed_chunks and not MixtralForCausalLM.launch_bound_prefill
    assert Qwen3MoeForCausalLM.prefers_mixed_chunks and Qwen3MoeForCausalLM.launch_bound_prefill


class CountingLlama(LlamaForCausalLM):
    """Llama declaring a trait and counting its weights_loaded calls."""

    prefers_mixed_chunks = True
    finished = 0

    def weights_loaded(self) -> None:
        type(self).finished += 1
        super().weights_loaded()


class _Plugin:
    @hookimpl
    def treadle_register_models(self, register):
        register("LlamaForCausalLM", CountingLlama)


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_the_loader_finishes_a_model_once_and_the_runner_reads_its_traits(tmp_path, load_format):
    CountingLlama.finished = 0
    registry = build_registry(["treadle.plugins.attention.torch_native", "treadle.plugins.kv_allocators.token"],
                              extra_plugins=[_Plugin()], load_entry_points=False)
    overrides = {"model.path": make_tiny_llama(tmp_path / "llama"), "model.device": "cpu", "model.load_format": load_format,
                 "attention.backend": "torch_native", "cache.max_total_tokens": 256}
    runner = ModelRunner(load_config(overrides=overrides, use_env=False), registry)
    assert CountingLlama.finished == 1
    assert runner.model_traits.prefers_mixed_chunks and runner.model_traits.splits_forward
