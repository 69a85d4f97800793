"""Mistral, registered as ``MistralForCausalLM``: Llama with an optional sliding attention window."""

from __future__ import annotations

from typing import Any

from treadle.core.hookspecs import Register, hookimpl
from treadle.plugins.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral causal LM; ``config.sliding_window`` (None for full attention) limits every layer's view:
    a query at position i sees keys i - W < j <= i."""

    def _sliding_window(self, config: Any) -> int | None:
        window = getattr(config, "sliding_window", None)
        return int(window) if window else None


@hookimpl
def treadle_register_models(register: Register) -> None:
    register("MistralForCausalLM", MistralForCausalLM)
