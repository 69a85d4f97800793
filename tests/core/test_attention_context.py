"""Attention backends are built from an AttentionContext, a frozen view of the model's attention shape and KV
memory, instead of the whole ModelRunner; a backend written for the old ``factory(model_runner)`` form keeps
working, and is told which field to read where it reaches past the view."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.core.config import load_config
from treadle.core.execution.attention import head_layout
from treadle.core.execution.attention_context import AttentionContext
from treadle.core.registry import build_registry
from treadle.plugins.attention.torch_native import TorchNativeAttnBackend

GREEDY = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 12, 40, 7], [3, 3, 8]]
DOCUMENTED = ("device", "dtype", "num_heads", "num_kv_heads", "head_dim", "page_size", "req_to_token_pool",
              "kv_cache", "sliding_window", "layer_sliding_windows", "context_len")


class Recording(TorchNativeAttnBackend):
    """torch_native, keeping what its factory was given."""

    seen: list = []

    def __init__(self, context) -> None:
        Recording.seen.append(context)
        super().__init__(context)


class WrittenForTheRunner(TorchNativeAttnBackend):
    """A backend as docs/plugins.md used to show it: it reads attributes of ``model_runner``, two of them beyond
    what the docs listed (the pool size and the config)."""

    def __init__(self, model_runner) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = head_layout(model_runner, "old-style")
        self.device = torch.device(model_runner.device)
        self.pool_tokens = model_runner.max_total_tokens
        self.chosen_backend = model_runner.config.attention.backend


def _engine(model_dir: str, name: str, factory) -> Engine:
    registry = build_registry()
    registry.add("attention", name, factory, "test")
    config = load_config(overrides={"model.path": model_dir, "model.device": "cpu", "cache.max_total_tokens": 512,
                                    "attention.backend": name}, use_env=False)
    return Engine(config, registry)


def test_a_backend_is_built_from_the_runners_attention_context(tiny_llama_dir) -> None:
    Recording.seen.clear()
    engine = _engine(tiny_llama_dir, "recording", Recording)
    runner = engine.scheduler.worker.runner
    (context,) = Recording.seen
    assert isinstance(context, AttentionContext)
    for name in DOCUMENTED:
        assert getattr(context, name) == getattr(runner, name), name
    assert context.kv_cache is runner.kv_cache and context.req_to_token_pool is runner.req_to_token_pool
    assert (context.kv_dtype, context.num_layers) == (runner.kv_dtype, runner.num_layers)
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.page_size = 16


def test_a_backend_written_for_the_model_runner_still_works_and_is_told_what_to_read(tiny_llama_dir) -> None:
    reference = Engine({"model": {"path": tiny_llama_dir, "device": "cpu"}, "cache": {"max_total_tokens": 512},
                        "attention": {"backend": "torch_native"}})
    expected = [o.token_ids for o in reference.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    with pytest.warns(DeprecationWarning) as caught:
        engine = _engine(tiny_llama_dir, "old-style", WrittenForTheRunner)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any("`max_total_tokens`" in m and "read `kv_cache.size`" in m for m in messages), messages
    assert any("`config`" in m and "no field for it" in m for m in messages), messages
    backend = engine.scheduler.worker.runner.attn_backend
    assert backend.pool_tokens == 512 and backend.chosen_backend == "old-style"
    assert [o.token_ids for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == expected


def test_a_name_neither_the_view_nor_the_runner_has_lists_the_fields() -> None:
    context = AttentionContext(device=torch.device("cpu"), dtype=torch.float32, kv_dtype=torch.float32,
                               num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, page_size=1, context_len=16,
                               req_to_token_pool=None, kv_cache=None)  # type: ignore[arg-type]
    with pytest.raises(AttributeError, match="has no attribute 'max_total_tokens'; it has: device, dtype"):
        context.max_total_tokens
