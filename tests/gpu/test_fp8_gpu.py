"""FP8 on a GPU with FP8 tensor cores: the linear kernels against bfloat16, and FP8 models/KV under CUDA graphs."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a GPU with FP8 tensor cores (compute capability 8.9+)", allow_module_level=True)

DEVICE = torch.device("cuda")
# Llama-3.1-8B's projections: qkv, o, gate_up, down.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.float() - reference.float()).norm() / reference.float().norm()).item()


@pytest.mark.parametrize("rows", [1, 7, 16, 33, 256])
@pytest.mark.parametrize("n, k", SHAPES)
def test_fp8_linear_is_close_to_bf16(n, k, rows):
    from treadle.plugins.models.fp8_kernels import W8A16_CONFIGS, w8a16_matmul
    from treadle.plugins.models.fp8_ops import fp8_matmul, quantize_per_channel, quantize_per_token

    gen = torch.Generator(device=DEVICE).manual_seed(n + k + rows)
    weight = (torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(rows, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    reference = x @ weight.t()
    wq, ws = quantize_per_channel(weight)
    w8a8 = fp8_matmul(*quantize_per_token(x), wq, ws, torch.bfloat16)
    assert w8a8.dtype == torch.bfloat16 and _relative_error(w8a8, reference) < 0.05
    if rows <= 16:
        for config in W8A16_CONFIGS:
            w8a16 = w8a16_matmul(x, wq, ws, config)
            assert _relative_error(w8a16, reference) < 0.04, config


def test_per_token_quant_kernel_matches_torch_rounding():
    from treadle.core.quantization import FP8_DTYPE, FP8_MAX
    from treadle.plugins.models.fp8_kernels import per_token_quant

    for k in (4096, 14336):  # one pass and two passes over the row
        x = torch.randn(9, k, device=DEVICE).to(torch.bfloat16) * torch.logspace(-2, 2, 9, device=DEVICE)[:, None]
        q, scale = per_token_quant(x, FP8_DTYPE, FP8_MAX, 1e-12)
        expected_scale = x.float().abs().amax(1, keepdim=True) / FP8_MAX
        assert torch.allclose(scale, expected_scale, rtol=1e-6)
        expected = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
        # Triton's float32 division and FP8 conversion may round differently from torch's near a halfway
        # point (0.24% of values on an H100): never by more than one FP8 step.
        one_step = expected.abs() * 2.0**-3 + 2.0**-9
        assert ((q.float() - expected).abs() <= one_step).all()
        assert (q.float() != expected).float().mean() < 0.01


def _greedy(model_dir: str, engine_config, backend: str, graphs: bool, **sections) -> list[list[int]]:
    from treadle.core.engine import Engine

    config = engine_config(model_dir, backend, "bfloat16", graphs=graphs)
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    engine = Engine(config)
    try:
        outs = engine.generate(input_ids=_prompts(), sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                                    "ignore_eos": True})
        return [out.token_ids for out in outs]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_fp8_model_gives_the_same_tokens_with_and_without_cuda_graphs(real_shape_llama_dir, engine_config, backend):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    model = {"quantization": "fp8"}
    eager = _greedy(real_shape_llama_dir, engine_config, backend, False, model=model)
    graphed = _greedy(real_shape_llama_dir, engine_config, backend, True, model=model)
    assert eager == graphed and all(len(tokens) == 12 for tokens in eager)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_fp8_kv_cache_gives_the_same_tokens_with_and_without_cuda_graphs(real_shape_llama_dir, engine_config,
                                                                         backend):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    cache = {"kv_dtype": "fp8_e4m3"}
    eager = _greedy(real_shape_llama_dir, engine_config, backend, False, cache=cache)
    graphed = _greedy(real_shape_llama_dir, engine_config, backend, True, cache=cache)
    assert eager == graphed and all(len(tokens) == 12 for tokens in eager)


def _prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 8000 + 3 for j in range(20 + 9 * i)] for i in range(5)]


def hf_greedy(model_dir: str, new_tokens: int, fp8_kv: bool) -> list[tuple[list[int], torch.Tensor]]:
    """HF greedy decoding in float32; with ``fp8_kv`` every key (after rotary) and value rounded through e4m3.

    Scale 1 per layer, as treadle's cache without checkpoint scales: this is what attention over an FP8
    KV cache computes when the new tokens are read back from the cache too (FlashInfer's prefill does).
    Returns per prompt the greedy tokens and the per-step float32 logits.
    """
    import transformers.models.llama.modeling_llama as modeling_llama
    from transformers import AutoModelForCausalLM

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float8_e4m3fn).to(x.dtype) if fp8_kv else x

    rotary = modeling_llama.apply_rotary_pos_emb

    def rotary_then_round(q, k, cos, sin, *args, **kwargs):
        q, k = rotary(q, k, cos, sin, *args, **kwargs)
        return q, round_trip(k)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    hooks = [layer.self_attn.v_proj.register_forward_hook(lambda module, args, out: round_trip(out))
             for layer in model.model.layers]
    modeling_llama.apply_rotary_pos_emb = rotary_then_round
    try:
        results = []
        with torch.inference_mode():
            for prompt in _prompts():
                ids = torch.tensor([prompt], device=DEVICE)
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True, pad_token_id=0)
                results.append((out.sequences[0, len(prompt):].tolist(),
                                torch.stack([step[0].float() for step in out.logits]).cpu()))
        return results
    finally:
        modeling_llama.apply_rotary_pos_emb = rotary
        for hook in hooks:
            hook.remove()


NEAR_TIE = 1.0


def test_flashinfer_fp8_kv_cache_computes_attention_over_fp8_rounded_kv(real_shape_llama_dir, engine_config):
    """FlashInfer over an FP8 KV cache lands on HF with FP8-rounded keys and values, far from unrounded HF.

    Rounding every key and value through e4m3 moves this random model's first-token log-probs by 1-4, and
    treadle rounds bf16 (not float32) values, so a flipped rounding moves a log-prob by tenths: per prompt,
    the first-token top-5 log-probs must be closer to the FP8-rounded reference than rounding moves them,
    and over all prompts less than half as far; greedy tokens identical up to the FP8 reference's first
    near tie (top-2 logit gap under 1.0).
    """
    pytest.importorskip("flashinfer")
    from treadle import Engine, SamplingParams

    config = engine_config(real_shape_llama_dir, "flashinfer", "bfloat16", graphs=True)
    config["cache"]["kv_dtype"] = "fp8_e4m3"
    engine = Engine(config)
    try:
        outputs = engine.generate(input_ids=_prompts(), return_logprob=True, top_logprobs_num=5,
                                  sampling_params=SamplingParams(max_new_tokens=12, temperature=0.0,
                                                                 ignore_eos=True))
    finally:
        engine.shutdown()
    rounded = hf_greedy(real_shape_llama_dir, 12, fp8_kv=True)
    plain = hf_greedy(real_shape_llama_dir, 1, fp8_kv=False)
    to_rounded, rounding = [], []
    for index, (output, (ref_tokens, ref_logits), (_, plain_logits)) in enumerate(zip(outputs, rounded, plain)):
        ref_logprobs = torch.log_softmax(ref_logits[0], dim=-1)
        plain_logprobs = torch.log_softmax(plain_logits[0], dim=-1)
        tokens = [token for token, _ in output.output_top_logprobs[0]]
        to_rounded.append(max(abs(lp - ref_logprobs[t].item()) for t, lp in output.output_top_logprobs[0]))
        rounding.append(max(abs(plain_logprobs[t] - ref_logprobs[t]).item() for t in tokens))
        print(f"prompt {index}: first-token log-probs {to_rounded[-1]:.3f} from the FP8-rounded reference, which "
              f"rounding moved by {rounding[-1]:.3f}; tokens {output.token_ids[:6]} vs {ref_tokens[:6]}")
        assert to_rounded[-1] < rounding[-1], f"prompt {index}: not closer to the FP8-rounded reference"
        for step, (ours, theirs) in enumerate(zip(output.token_ids, ref_tokens)):
            if ours != theirs:
                top2 = ref_logits[step].topk(2).values
                assert (top2[0] - top2[1]).item() < NEAR_TIE, (
                    f"prompt {index}: step {step} picked {ours}, reference {theirs} with a clear top-2 gap")
                break
    assert sum(to_rounded) < 0.5 * sum(rounding), (to_rounded, rounding)
