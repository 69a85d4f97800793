"""LoRA adapters on the GPU at Llama-3.1-8B's attention shapes: HF transformers + PEFT's greedy tokens with the
torch and triton backends, decode and prefill CUDA graphs replaying the adapters' deltas (the slot ids copied into
the graphs' static batch context) as eager steps compute them, and FP8 base weights with 16-bit adapters.

Run on the device machine: ``python -m pytest -q tests/gpu/test_lora_gpu.py``.
"""

from __future__ import annotations

import pytest

from graph_replays import ReplayCounter
from near_tie import assert_plain_or_near_tie
from peft_adapters import ALL_PROJECTIONS, ATTENTION, make_peft_adapter, peft_greedy
from treadle import Engine

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2, 150, 77, 45, 18], [300, 301, 9], [1000, 1001, 1002, 40]]
NAMES = ["all16", None, "attn64", None, "attn64", "all16"]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(real_shape_llama_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gpu-adapters")
    return {"all16": make_peft_adapter(real_shape_llama_dir, root / "all16", rank=16, targets=ALL_PROJECTIONS,
                                       std=0.03),
            "attn64": make_peft_adapter(real_shape_llama_dir, root / "attn64", rank=64, targets=ATTENTION, seed=2,
                                        std=0.02)}


def _config(model_dir: str, adapters: dict[str, str], backend: str, dtype: str, graphs: bool) -> dict:
    return {"model": {"path": model_dir, "dtype": dtype, "device": "cuda", "context_length": 2048},
            "cache": {"max_total_tokens": 16384}, "scheduler": {"max_running_requests": 16},
            "runtime": {"disable_cuda_graph": not graphs, "cuda_graph_max_bs": 16,
                        "piecewise_cuda_graph_max_tokens": 256 if graphs else 0},
            "lora": {"paths": adapters, "backend": backend, "max_rank": 64, "max_loras_per_batch": 4},
            "plugins": ["treadle.plugins.lora_backends.torch", "treadle.plugins.lora_backends.triton"]}


def _run(config: dict) -> tuple[list, int, int]:
    """The requests' outputs (with their two best log-probs per token) and the decode and prefill graph replays."""
    with Engine(config) as engine:
        worker = engine.scheduler.worker
        decode, prefill = ReplayCounter(worker.cuda_graphs), ReplayCounter(worker.piecewise_graphs)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(NAMES))]
        outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=NAMES, return_logprob=True,
                                  top_logprobs_num=2)
        return outputs, decode.count, prefill.count


@pytest.mark.parametrize("backend", ["torch", "triton", "triton_sorted", "triton_dense"])
def test_float32_matches_peft_through_cuda_graphs(real_shape_llama_dir, adapters, backend, monkeypatch):
    """``triton_sorted``: the sorted form from 3 tokens (LoRAKernelChoice.sort_above=2), so the decode graphs of 6
    requests (8 rows) and the prefill graphs run it over the order their static context sorts each replay;
    ``triton_dense``: the dense form from 3 tokens (dense_above=2), its mask built in the graphs from their static
    slot ids."""
    kernels = {"triton_sorted": "sort_above=2", "triton_dense": "dense_above=2"}.get(backend)
    if kernels:
        monkeypatch.setenv("TREADLE_LORA_KERNELS", kernels)  # read when the backend is built
        backend = "triton"
    references = {name: peft_greedy(real_shape_llama_dir, path, PROMPTS, GREEDY["max_new_tokens"])
                  for name, path in {**adapters, None: None}.items()}
    outputs, decode_replays, prefill_replays = _run(_config(real_shape_llama_dir, adapters, backend, "float32", True))
    assert decode_replays > 0 and prefill_replays > 0
    assert [o.token_ids for o in outputs] == [references[name][i % len(PROMPTS)] for i, name in enumerate(NAMES)]


@pytest.fixture(scope="module")
def fp8_llama_dir(real_shape_llama_dir, tmp_path_factory) -> str:
    """The real-shape Llama's shape as an FP8 checkpoint (its own random weights, quantized)."""
    import json
    from pathlib import Path

    from treadle.testing.models import make_tiny_fp8_llama

    config = json.loads((Path(real_shape_llama_dir) / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "max_position_embeddings", "rope_theta", "rope_scaling", "rms_norm_eps")
    # transformers 5 keeps rope_theta inside rope_parameters: copy only the keys the folder has.
    return make_tiny_fp8_llama(tmp_path_factory.mktemp("fp8-llama"), **{key: config[key] for key in keys if key in config})


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("weights", ["bfloat16", "fp8"])
def test_bfloat16_graphs_replay_what_eager_steps_compute(real_shape_llama_dir, fp8_llama_dir, adapters, weights,
                                                         backend):
    """Decode graphs replay the adapters' deltas as eager steps compute them, 16-bit and FP8 base weights alike
    (the adapters stay 16-bit). A graph runs its batch padded, so its GEMMs differ in shape from the eager steps'
    and bf16 rounding may flip a near-tie of the random weights: each request equals its eager twin or parts from
    it first at a near-tie of the eager run's two best tokens."""
    model_dir = fp8_llama_dir if weights == "fp8" else real_shape_llama_dir
    eager, _, _ = _run(_config(model_dir, adapters, backend, "bfloat16", False))
    graphed, decode_replays, _ = _run(_config(model_dir, adapters, backend, "bfloat16", True))
    assert decode_replays > 0
    assert_plain_or_near_tie(graphed, eager, min_equal=len(NAMES) // 2)
    tokens = [o.token_ids for o in eager]
    assert tokens[0] != tokens[3] and tokens[1] != tokens[4]  # each adapter changes the base's tokens
