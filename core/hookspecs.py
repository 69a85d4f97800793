"""The plugin contract: hooks, one per plugin kind, each handed a ``register(name, factory)`` callback."""

from __future__ import annotations

from typing import Any, Callable

import pluggy

PROJECT_NAME = "treadle"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[str, Any], None]


class Spec:
    """Hook specifications every treadle plugin implements a subset of."""

    @hookspec
    def treadle_register_attention_backends(self, register: Register) -> None:
        """Register AttentionBackend factories: ``register("name", factory(model_runner))``."""

    @hookspec
    def treadle_register_models(self, register: Register) -> None:
        """Register model classes by HF architecture name (``"LlamaForCausalLM"``)."""

    @hookspec
    def treadle_register_schedule_policies(self, register: Register) -> None:
        """Register SchedulePolicy factories: ``register("name", factory(seed))``."""

    @hookspec
    def treadle_register_kv_allocators(self, register: Register) -> None:
        """Register KVAllocator factories: ``register("name", factory(size, page_size, device))``."""

    @hookspec
    def treadle_register_tool_parsers(self, register: Register) -> None:
        """Register ToolParser factories (``treadle.text.tool_parser``): ``register("name", factory())``."""

    @hookspec
    def treadle_register_reasoning_parsers(self, register: Register) -> None:
        """Register ReasoningParser factories (``treadle.text.reasoning_parser``): ``register("name", factory())``."""

    @hookspec
    def treadle_register_grammar_backends(self, register: Register) -> None:
        """Register GrammarBackend factories: ``register("name", factory(tokenizer=, vocab_size=, ...))``."""

    @hookspec
    def treadle_register_speculators(self, register: Register) -> None:
        """Register Speculator factories (``treadle.core.speculative.speculator``):
        ``register("name", factory(target_worker, resolved_config, registry))``."""

    @hookspec
    def treadle_register_lora_backends(self, register: Register) -> None:
        """Register LoRABackend factories (``treadle.core.lora.backend``):
        ``register("name", factory(max_slots, max_rank, device, dtype))``."""

    @hookspec
    def treadle_register_quantization_methods(self, register: Register) -> None:
        """Register QuantizationMethod factories (``treadle.core.loading.quantization_method``):
        ``register("name", factory())``."""

    @hookspec
    def treadle_register_poolings(self, register: Register) -> None:
        """Register Pooling factories for embedding models (``treadle.core.embedding.pooling``):
        ``register("name", factory())``."""


# kind -> hook name; the kinds are the keys of `treadle plugins --json`.
HOOKS_BY_KIND: dict[str, str] = {
    "attention": "treadle_register_attention_backends",
    "models": "treadle_register_models",
    "schedule_policies": "treadle_register_schedule_policies",
    "kv_allocators": "treadle_register_kv_allocators",
    "tool_parsers": "treadle_register_tool_parsers",
    "reasoning_parsers": "treadle_register_reasoning_parsers",
    "grammar_backends": "treadle_register_grammar_backends",
    "speculators": "treadle_register_speculators",
    "lora_backends": "treadle_register_lora_backends",
    "quantization_methods": "treadle_register_quantization_methods",
    "poolings": "treadle_register_poolings",
}

KIND_LABELS: dict[str, str] = {
    "attention": "attention backend",
    "models": "model architecture",
    "schedule_policies": "schedule policy",
    "kv_allocators": "KV allocator",
    "tool_parsers": "tool parser",
    "reasoning_parsers": "reasoning parser",
    "grammar_backends": "grammar backend",
    "speculators": "speculator",
    "lora_backends": "LoRA backend",
    "quantization_methods": "quantization method",
    "poolings": "pooling",
}
