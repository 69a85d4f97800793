"""Tensor parallelism on 2 GPUs (NCCL, CUDA graphs capturing the all-reduce): tp=2 generates what tp=1 does.

Needs a machine with at least two GPUs (e.g. nvidia-h200-x2); skipped elsewhere. Run with
``bash tests/gpu/multi_gpu.sh setup tp_tests``.

- float32 (triton): identical greedy tokens for every prompt; row-parallel layers only reorder
  float32 sums, far below these random weights' logit gaps.
- bfloat16 (triton, flashinfer): this random model is very sensitive to bf16 rounding (at tp=1
  its first-step log-probs sit up to 1.5 from float32's, and a 0.19 top-2 gap flipped between tp=1
  and tp=2 on the first NCCL run), so tokens are not compared; instead tp=2's first-step log-probs
  must be about as close to an HF float32 reference as tp=1's are. The agreement is printed.
- FP8 weights (``model.quantization: fp8``, dense and MoE): each rank quantizes its own activations and scales its
  own half of a row-parallel weight row (docs/parallel.md), so tokens are not compared either; tp=2's first-step
  log-probs must be about as close to the float32 reference as tp=1's.
- Mixtral (the Triton fused-MoE kernel over each rank's slice of every expert) in float32: identical tokens.
"""

from __future__ import annotations

import pytest
import torch

from treadle import Engine
from treadle.testing.engine import assert_kv_accounted

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

NEW_TOKENS = 24
TOP = 5  # log-probs compared at each prompt's first generated position
CASES = [("triton", "float32"), ("triton", "bfloat16"), ("flashinfer", "bfloat16")]


# A Mixtral small enough to build in seconds, wide enough that each rank's expert slice (256 of 512) and attention
# heads (4 of 8) are real tiles for the GPU kernels.
MIXTRAL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
               vocab_size=1024, max_position_embeddings=2048)


def _prompts(vocab_size: int = 8000) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(10, vocab_size, (n,), generator=generator).tolist() for n in (5, 37, 130, 300, 700)]


def _hf_first_logprobs(model_dir: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """HF transformers in float32: each prompt's next-token log-probs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    with torch.no_grad():
        logprobs = [torch.log_softmax(model(torch.tensor([ids], device="cuda")).logits[0, -1], -1).cpu()
                    for ids in prompts]
    del model
    torch.cuda.empty_cache()
    return logprobs


@pytest.fixture(scope="module")
def fp32_first_logprobs(real_shape_llama_dir) -> list[torch.Tensor]:
    return _hf_first_logprobs(real_shape_llama_dir, _prompts())


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> str:
    from treadle.testing.models import make_tiny_mixtral

    return make_tiny_mixtral(tmp_path_factory.mktemp("tp-mixtral"), seed=3, **MIXTRAL)


def _run(engine: Engine, new_tokens: list[int],
         prompts: list[list[int]] | None = None) -> list[tuple[list[int], list[tuple[int, float]]]]:
    """Per prompt: (greedy tokens, the TOP best (token, log-prob) at the first generated position)."""
    outputs = engine.generate(input_ids=prompts or _prompts(), return_logprob=True, top_logprobs_num=TOP,
                              sampling_params=[{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
                                               for n in new_tokens])
    assert_kv_accounted(engine)
    return [(out.token_ids, out.output_top_logprobs[0]) for out in outputs]


def _first_step_error(outputs: list, reference: list[torch.Tensor]) -> float:
    """Mean over prompts of the largest |log-prob - float32 reference| among the first position's TOP tokens."""
    return sum(max(abs(value - ref[token].item()) for token, value in top)
               for (_, top), ref in zip(outputs, reference)) / len(outputs)


def _assert_tp2_matches_tp1(expected: list, got: list, dtype: str, label: str,
                            reference: list[torch.Tensor]) -> None:
    """float32: identical tokens. bf16 or FP8 weights: first-step log-probs about as close to float32 at tp=2 as at
    tp=1."""
    total = sum(len(ids) for ids, _ in expected)
    same = sum(a == b for (want, _), (have, _) in zip(expected, got) for a, b in zip(want, have))
    error_tp1, error_tp2 = _first_step_error(expected, reference), _first_step_error(got, reference)
    print(f"{label}: tp=2 agrees with tp=1 on {same}/{total} tokens; first-step log-probs off float32 by "
          f"{error_tp1:.3f} at tp=1, {error_tp2:.3f} at tp=2 (mean over prompts of the largest of the top {TOP})")
    if dtype == "float32":
        assert [ids for ids, _ in got] == [ids for ids, _ in expected]
        assert error_tp2 < 2e-3  # the float32 tolerance of the HF parity test
    else:
        assert error_tp2 <= 1.5 * error_tp1 + 0.05


def _generate(config: dict, tp_size: int, prompts: list[list[int]] | None = None) -> list:
    config = {**config, "parallel": {"tp_size": tp_size}}
    prompts = prompts or _prompts()
    with Engine(config) as engine:
        assert engine.scheduler.worker.cuda_graphs is not None, "CUDA graphs must be on (they capture the NCCL all-reduce)"
        return _run(engine, [NEW_TOKENS] * len(prompts), prompts)


@pytest.mark.parametrize(("backend", "dtype"), CASES)
def test_tp2_matches_tp1_with_cuda_graphs(real_shape_llama_dir, engine_config, fp32_first_logprobs, backend, dtype):
    config = engine_config(real_shape_llama_dir, backend, dtype, graphs=True)
    _assert_tp2_matches_tp1(_generate(config, 1), _generate(config, 2), dtype, f"{backend} {dtype}",
                            fp32_first_logprobs)


def test_tp2_fp8_weights_stay_as_close_to_float32_as_tp1(real_shape_llama_dir, engine_config, fp32_first_logprobs):
    """FP8 weights quantized at load on each rank's slice: prefill through ``torch._scaled_mm``, decode through the
    one-token GEMVs and the W8A8 tiles of 2-5 rows, all-reduces captured in the decode graphs."""
    config = engine_config(real_shape_llama_dir, "triton", "bfloat16", graphs=True)
    config["model"]["quantization"] = "fp8"
    _assert_tp2_matches_tp1(_generate(config, 1), _generate(config, 2), "fp8", "triton fp8", fp32_first_logprobs)


@pytest.mark.parametrize("dtype", ["float32", "fp8"])
def test_tp2_mixtral_matches_tp1(mixtral_dir, engine_config, dtype):
    """The fused-MoE kernel over each rank's half of every expert, its output all-reduced; ``fp8``: bf16 with
    ``quantization: fp8`` (the experts quantized on each rank too)."""
    prompts = _prompts(MIXTRAL["vocab_size"])[:4]
    config = engine_config(mixtral_dir, "triton", "float32" if dtype == "float32" else "bfloat16", graphs=True)
    if dtype == "fp8":
        config["model"]["quantization"] = "fp8"
    _assert_tp2_matches_tp1(_generate(config, 1, prompts), _generate(config, 2, prompts), dtype,
                            f"mixtral {dtype}", _hf_first_logprobs(mixtral_dir, prompts))


PIECEWISE_CASES = [("triton", "float32"), ("flashinfer", "bfloat16")]
# Different lengths, so that with two running at a time the waiting prompts trickle in beside a decode.
PIECEWISE_NEW_TOKENS = [NEW_TOKENS, 8, 16, 12, 20]


def _generate_piecewise(config: dict, tp_size: int) -> tuple[list, int, int]:
    """Greedy tokens with prefill CUDA graphs (their pieces capture the row-parallel all-reduces) and latency
    chunks (prompt pieces mixed into decode steps), the extend batches that replayed the pieces, and the mixed
    steps. Prefills are not held (a held prompt waits for the decode beside it to end, and no step mixes)."""
    from batch_log import record_batches
    from graph_replays import ReplayCounter

    from treadle.core.execution.forward_batch import ForwardMode

    config = {**config, "parallel": {"tp_size": tp_size},
              "runtime": {**config["runtime"], "piecewise_cuda_graph_max_tokens": 1024},
              "scheduler": {**config["scheduler"], "max_running_requests": 2, "latency_chunk_size": 64,
                            "prefill_hold_steps": 0}}
    with Engine(config) as engine:
        worker = engine.scheduler.worker
        assert worker.piecewise_graphs is not None
        replays = ReplayCounter(worker.piecewise_graphs)
        modes = record_batches(engine, lambda batch: batch.forward_mode)
        outputs = _run(engine, PIECEWISE_NEW_TOKENS)
        return outputs, replays.count, modes.count(ForwardMode.MIXED)


@pytest.mark.parametrize(("backend", "dtype"), PIECEWISE_CASES)
def test_tp2_piecewise_prefill_graphs_and_latency_chunks_match_tp1(real_shape_llama_dir, engine_config,
                                                                   fp32_first_logprobs, backend, dtype):
    config = engine_config(real_shape_llama_dir, backend, dtype, graphs=True)
    expected, _, _ = _generate_piecewise(config, 1)
    got, replays, mixed = _generate_piecewise(config, 2)
    print(f"{backend} {dtype} piecewise: {replays} piecewise replays, {mixed} mixed steps at tp=2")
    assert replays >= 2 and mixed >= 1
    _assert_tp2_matches_tp1(expected, got, dtype, f"{backend} {dtype} piecewise", fp32_first_logprobs)
