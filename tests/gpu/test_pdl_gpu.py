"""Programmatic dependent launch (kernels/pdl.py) changes no result: a chain of one-token GEMVs that each read the
one before, replayed from a CUDA graph, and whole models' greedy tokens, with PDL on and off."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("PDL needs a Hopper or newer GPU", allow_module_level=True)

DEVICE = torch.device("cuda")


def _chain(weights: torch.Tensor, x: torch.Tensor, configs) -> list[torch.Tensor]:
    """Each GEMV multiplies the previous one's output: a missing wait would read it before it is written."""
    from treadle.kernels.small_batch import small_batch_matmul

    outputs = []
    for i, config in enumerate(configs):
        x = small_batch_matmul(x, weights[i % len(weights)], None, config)
        outputs.append(x)
    return outputs


def test_a_chain_of_gemvs_replayed_with_pdl_matches_eager_without(monkeypatch):
    from treadle.kernels import pdl
    from treadle.kernels.small_batch import SIXTEEN_BIT_CONFIGS

    assert pdl.enabled(DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    weights = (torch.randn(3, 4096, 4096, device=DEVICE, generator=gen) / 64).to(torch.bfloat16)
    x = torch.randn(1, 4096, device=DEVICE, generator=gen).to(torch.bfloat16)
    configs = [config for config in SIXTEEN_BIT_CONFIGS if config.gemv] * 4
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = _chain(weights, x, configs)
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setenv("TREADLE_PDL", "0")
    assert not pdl.enabled(DEVICE)
    expected = _chain(weights, x, configs)
    for want, got in zip(expected, replayed):
        assert torch.equal(want, got)


def _greedy(model_dir: str, engine_config, prompts: list[list[int]], model: dict) -> list[list[int]]:
    from treadle.core.engine import Engine

    config = engine_config(model_dir, "triton", "bfloat16", graphs=True)
    config["model"].update(model)
    engine = Engine(config)
    try:
        outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 16, "temperature": 0,
                                                                   "ignore_eos": True})
        return [out.token_ids for out in outs]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("model", [{}, {"quantization": "fp8"}], ids=["bf16", "fp8-weights"])
def test_decode_gives_the_same_tokens_with_and_without_pdl(real_shape_llama_dir, engine_config, model, monkeypatch):
    prompts = [[(7 * i + 13 * j) % 8000 + 3 for j in range(20 + 37 * i)] for i in range(5)]

    def run() -> list[list[int]]:
        # One request alone decodes through the one-token GEMVs; five together through the tiles.
        return _greedy(real_shape_llama_dir, engine_config, prompts[:1], model) + \
            _greedy(real_shape_llama_dir, engine_config, prompts, model)

    with_pdl = run()
    monkeypatch.setenv("TREADLE_PDL", "0")
    assert with_pdl == run()
