"""treadle's plugin conformance kit: pytest-callable checks a plugin package runs in its own tests.

    from treadle.testing import check_attention_backend, check_kv_allocator, check_schedule_policy
    from treadle.testing import check_grammar_backend

    def test_my_policy_conforms():
        check_schedule_policy(MyPolicy)

    def test_my_tool_parser_conforms():
        check_tool_parser(MyToolParser)

    def test_my_attention_backend_conforms():
        check_attention_backend(MyAttnBackend, "cuda", torch.bfloat16)

    def test_my_grammar_backend_conforms():
        check_grammar_backend(MyGrammarBackend)

    def test_my_speculator_conforms():
        check_speculator(make_my_speculator)

    def test_my_lora_backend_conforms():
        check_lora_backend(MyLoRABackend, "cuda", torch.bfloat16)   # or a registered name: "triton"

    def test_my_quantization_method_conforms():
        check_quantization_method(MyMethod, {"quant_method": "mine"}, my_layer_tensors)

    def test_my_pooling_conforms():
        check_pooling(MyPooling)

    def test_my_model_splits_over_ranks():
        check_tensor_parallel(make_my_tiny_checkpoint(tmp_path), tp_size=2,
                              overrides={"plugins": ["my_models"]})

Each check raises AssertionError naming the broken rule. The kit depends on
treadle's core only (built-in plugins are reached through the registry).
"""

from __future__ import annotations

from typing import Any

from treadle.testing.allocators import check_kv_allocator
from treadle.testing.lora import check_lora_backend
from treadle.testing.embedding import check_pooling
from treadle.testing.parallel import check_tensor_parallel
from treadle.testing.parsers import check_reasoning_parser, check_tool_parser
from treadle.testing.policies import check_schedule_policy

__all__ = ["check_attention_backend", "check_grammar_backend", "check_kv_allocator", "check_lora_backend",
           "check_pooling", "check_quantization_method", "check_reasoning_parser", "check_schedule_policy",
           "check_speculator", "check_tensor_parallel", "check_tool_parser"]


def __getattr__(name: str) -> Any:
    # The attention and grammar checks live in their own modules, imported on first use.
    if name == "check_attention_backend":
        from treadle.testing.attention import check_attention_backend

        return check_attention_backend
    if name == "check_speculator":
        from treadle.testing.speculators import check_speculator

        return check_speculator
    if name == "check_grammar_backend":
        from treadle.testing.grammar import check_grammar_backend

        return check_grammar_backend
    if name == "check_quantization_method":
        from treadle.testing.quantization import check_quantization_method

        return check_quantization_method
    raise AttributeError(f"module 'treadle.testing' has no attribute {name!r}")
