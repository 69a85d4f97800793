"""Mistral, registered as ``MistralForCausalLM``: Llama with an optional sliding attention window."""

from __future__ import annotations

from typing import Any

from torch import nn

from treadle.core.hookspecs import Register, hookimpl
from treadle.layers.decoder import DecoderLayer
from treadle.plugins.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral causal LM; ``config.sliding_window`` (None for full attention) limits every layer's view:
    a query at position i sees keys i - W < j <= i."""

    def make_layer(self, config: Any, layer_id: int) -> nn.Module:
        window = getattr(config, "sliding_window", None)
        return DecoderLayer(config, layer_id, int(window) if window else None, quant_config=self.quant_config)


@hookimpl
def treadle_register_models(register: Register) -> None:
    register("MistralForCausalLM", MistralForCausalLM)
