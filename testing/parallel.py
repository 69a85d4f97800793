"""Tensor-parallel check for model plugins: the same greedy tokens at tp 1 and tp N (gloo, CPU)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from treadle.testing.engine import assert_kv_accounted

DEFAULT_PROMPTS: list[list[int]] = [
    [5, 17, 99, 250, 7, 300, 12, 44, 91, 3],
    [8, 200, 201, 202, 203, 204, 205, 206, 207, 208, 11, 13, 17, 19, 23, 29, 31, 37],
    [42, 43],
]


def check_tensor_parallel(
    model_path: str,
    tp_size: int = 2,
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS,
    max_new_tokens: int = 8,
    overrides: Mapping[str, Any] | None = None,
) -> list[list[int]]:
    """Run the model at ``model_path`` (an HF folder whose architecture a plugin registers) on the CPU at
    tp 1 and at ``tp_size`` (processes over gloo) and assert token-identical greedy output, and that
    every rank's KV pool is fully accounted for afterwards. Returns the tokens.

    ``overrides`` is merged into the engine config (e.g. ``{"plugins": ["my_models"]}``,
    ``{"model": {"load_format": "dummy"}}``); the plugin must be importable by every rank.
    """
    from treadle.core.engine import Engine

    config: dict[str, Any] = {
        "model": {"path": model_path, "device": "cpu", "dtype": "float32"},
        "cache": {"max_total_tokens": 1024},
        "scheduler": {"max_running_requests": 8},
    }
    for section, values in (overrides or {}).items():
        config[section] = {**config.get(section, {}), **values} if isinstance(values, Mapping) else values
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    ids = [list(p) for p in prompts]

    with Engine(config) as engine:
        expected = [out.token_ids for out in engine.generate(input_ids=ids, sampling_params=params)]
    parallel = {**config, "parallel": {**config.get("parallel", {}), "tp_size": tp_size}}
    with Engine(parallel) as engine:
        got = [out.token_ids for out in engine.generate(input_ids=ids, sampling_params=params)]
        assert_kv_accounted(engine)
    for i, (want, have) in enumerate(zip(expected, got)):
        assert want == have, (
            f"prompt {i}: tp={tp_size} generated {have} but tp=1 generated {want}; the model's layers do not "
            "split exactly (build it from treadle.layers.linear's parallel blocks)")
    return got
