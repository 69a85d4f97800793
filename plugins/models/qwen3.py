"""Qwen3 (dense), registered as ``Qwen3ForCausalLM``: Llama with a per-head RMSNorm on q and k
before the rotary embedding, an explicit ``head_dim``, and ``attention_bias`` for all four projections."""

from __future__ import annotations

from typing import Any

from torch import nn

from treadle.core.hookspecs import Register, hookimpl
from treadle.layers.decoder import DecoderLayer, layer_sliding_window
from treadle.plugins.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 causal LM."""

    def make_layer(self, config: Any, layer_id: int) -> nn.Module:
        return DecoderLayer(config, layer_id, layer_sliding_window(config, layer_id), quant_config=self.quant_config,
                            qk_norm=True)


@hookimpl
def treadle_register_models(register: Register) -> None:
    register("Qwen3ForCausalLM", Qwen3ForCausalLM)
