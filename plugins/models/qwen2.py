"""Qwen2 / Qwen2.5, registered as ``Qwen2ForCausalLM``: Llama with biased q/k/v projections
(o_proj has none) and optional sliding-window layers (``use_sliding_window``, ``max_window_layers``,
read through ``config.layer_types``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from treadle.core.hookspecs import Register, hookimpl
from treadle.layers.decoder import DecoderLayer, layer_sliding_window
from treadle.plugins.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 causal LM."""

    def make_layer(self, config: Any, layer_id: int) -> nn.Module:
        return DecoderLayer(config, layer_id, layer_sliding_window(config, layer_id), quant_config=self.quant_config,
                            qkv_bias=True, o_bias=False)


@hookimpl
def treadle_register_models(register: Register) -> None:
    register("Qwen2ForCausalLM", Qwen2ForCausalLM)
