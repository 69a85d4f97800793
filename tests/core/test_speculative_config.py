"""The ``speculative:`` config section: defaults (off), bad combinations refused with the key's path, the method
checked against the registered speculators, ``max_batch_size: auto`` resolved per device."""

from __future__ import annotations

import pytest

from treadle.core.config import ConfigError, load_config, validate_plugin_choices
from treadle.core.registry import build_registry
from treadle.core.resolved_config import RuntimeFacts, resolve_config

CPU = RuntimeFacts(device="cpu", dtype="float32", context_length=2048, kv_bytes_per_token=4096, kv_dtype="float32")
H100 = RuntimeFacts(device="cuda", dtype="bfloat16", context_length=8192, kv_bytes_per_token=128 * 1024,
                    kv_dtype="bfloat16", device_total_bytes=80 * 1024**3, device_free_bytes=64 * 1024**3)


def test_speculation_is_off_by_default():
    config = load_config(use_env=False)
    assert config.speculative.method is None
    assert config.speculative.num_tokens == 4 and config.speculative.topk == 1


@pytest.mark.parametrize("overrides, message", [
    ({"speculative.method": "eagle", "speculative.topk": 2}, r"speculative: .*topk 2: method 'eagle' proposes "
                                                              r"chains only; .*\(draft, eagle3, ngram\)"),
    ({"speculative.topk": 5}, r"topk 5 must not exceed num_tokens 4"),
    ({"speculative.ngram_min": 5, "speculative.ngram_max": 3}, r"ngram_min 5 must not exceed ngram_max 3"),
    ({"speculative.method": "draft"}, r"method 'draft' needs draft_model_path"),
    ({"speculative.method": "eagle3"}, r"method 'eagle3' needs draft_model_path"),
    ({"speculative.num_tokens": 0}, r"speculative\.num_tokens"),
    ({"speculative.max_batch_size": 0}, r"max_batch_size must be a positive integer or 'auto'"),
    ({"speculative.ngram_size": 3}, r"speculative\.ngram_size: unknown key"),
])
def test_bad_combinations_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides, use_env=False)


def test_an_unknown_method_lists_the_registered_speculators():
    config = load_config(overrides={"speculative.method": "ngarm"}, use_env=False)
    registry = build_registry()
    with pytest.raises(ConfigError, match=r"speculative\.method: unknown speculator 'ngarm'; available: "):
        validate_plugin_choices(config, registry)


def test_max_batch_size_auto_is_resolved_per_device_and_explicit_values_win():
    config = load_config(overrides={"speculative.method": "ngram"}, use_env=False)
    assert resolve_config(config, H100).speculative.max_batch_size == 32
    assert resolve_config(config, CPU).speculative.max_batch_size == 4
    explicit = load_config(overrides={"speculative.max_batch_size": 12}, use_env=False)
    resolved = resolve_config(explicit, CPU)
    assert resolved.speculative.max_batch_size == 12 and resolved.speculative.method is None
    assert explicit.speculative.max_batch_size == 12
