"""The Triton fused-MoE kernel on a GPU: Mixtral-8x7B expert shapes against the PyTorch expert loop,
CUDA-graph capture, and a tiny Mixtral served end to end with HF-identical greedy output."""

from __future__ import annotations

import pytest
import torch

from treadle.layers import fused_moe
from treadle.kernels import fused_moe as fused_moe_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _experts(hidden, inter, experts, dtype, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=generator) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=generator) * inter**-0.5
    return w13.to(dtype), w2.to(dtype), generator


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_kernel_matches_the_torch_loop(tokens, dtype, tolerance):
    hidden, inter = (4096, 14336) if dtype == torch.bfloat16 else (512, 384)
    w13, w2, generator = _experts(hidden, inter, 8, dtype)
    x = torch.randn(tokens, hidden, device="cuda", generator=generator).to(dtype)
    weights, ids = fused_moe.route_top_k(torch.randn(tokens, 8, device="cuda", generator=generator), 2)
    got = fused_moe_kernels.fused_experts(x, w13, w2, weights, ids).float()
    want = fused_moe.fused_experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    assert ((got - want).abs().max() / want.abs().max()).item() <= tolerance


@pytest.mark.parametrize("tokens", [1, 12, 16, 64, 1024])
def test_qwen3_moe_shapes_match_the_torch_loop(tokens):
    """128 experts, top-8, narrow experts (Qwen3-30B-A3B): up to 15 tokens take the GEMVs, 16 and more the grouped
    GEMM; 1024 tokens (8192 assignments) sort in two launches."""
    w13, w2, generator = _experts(2048, 768, 128, torch.bfloat16)
    x = torch.randn(tokens, 2048, device="cuda", generator=generator).to(torch.bfloat16)
    weights, ids = fused_moe.route_top_k(torch.randn(tokens, 128, device="cuda", generator=generator), 8)
    got = fused_moe_kernels.fused_experts(x, w13, w2, weights, ids).float()
    want = fused_moe.fused_experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 2e-2


def _fp8_experts(generator):
    """Mixtral-8x7B-shaped FP8 experts with a scale per weight row (an FP8 checkpoint's): (q13, s13, q2, s2)."""
    w13, w2, _ = _experts(4096, 14336, 8, torch.bfloat16)
    s13 = w13.float().abs().amax(dim=2) / 448
    s2 = w2.float().abs().amax(dim=2) / 448
    return (w13.float() / s13[..., None]).to(torch.float8_e4m3fn), s13, (w2.float() / s2[..., None]).to(
        torch.float8_e4m3fn), s2


@pytest.mark.parametrize("tokens", [1, 3])  # the GEMVs (W8A16)
def test_fp8_experts_match_the_torch_loop_over_their_dequantized_weights(tokens):
    generator = torch.Generator(device="cuda").manual_seed(1)
    q13, s13, q2, s2 = _fp8_experts(generator)
    x = torch.randn(tokens, 4096, device="cuda", generator=generator).to(torch.bfloat16)
    weights, ids = fused_moe.route_top_k(torch.randn(tokens, 8, device="cuda", generator=generator), 2)
    got = fused_moe_kernels.fused_experts(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2).float()
    want = fused_moe.fused_experts_reference(x.float(), q13.float() * s13[..., None], q2.float() * s2[..., None],
                                             weights, ids)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 2e-2


def _w8a8_reference(x, q13, s13, q2, s2, weights, ids):
    """The grouped GEMM's W8A8 arithmetic in PyTorch: tokens and the activated rows quantized per row (the same
    quantizer), each product of dequantized FP8 in float32, rounded to bf16 where the kernels store."""
    from treadle.kernels.fp8_ops import quantize_per_token

    xq, xs = quantize_per_token(x)
    rows = xq.float() * xs
    gate_up = torch.empty((*ids.shape, q13.shape[1]), dtype=torch.bfloat16, device=x.device)
    for expert in range(q13.shape[0]):  # one expert's weights dequantized at a time
        hit = ids == expert
        gate_up[hit] = (rows[hit.nonzero()[:, 0]] @ (q13[expert].float() * s13[expert, :, None]).T).to(torch.bfloat16)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate).to(torch.bfloat16).float() * up).to(torch.bfloat16)
    aq, scale = quantize_per_token(act.reshape(-1, act.shape[-1]))
    act_rows = (aq.float() * scale).reshape(act.shape)
    down = torch.empty((*ids.shape, x.shape[1]), dtype=torch.float32, device=x.device)
    for expert in range(q2.shape[0]):
        hit = ids == expert
        down[hit] = act_rows[hit] @ (q2[expert].float() * s2[expert, :, None]).T
    return (down * weights[..., None]).to(torch.bfloat16).float().sum(dim=1)


@pytest.mark.parametrize("tokens", [8, 40, 300])  # the grouped GEMM (W8A8), 16- and 64-row tiles
def test_fp8_experts_grouped_gemm_multiplies_fp8_rows(tokens):
    """Past the GEMVs FP8 experts run W8A8: against the same arithmetic in PyTorch (tight), and against bf16 rows
    times the dequantized weights (the error FP8 rows add, bounded)."""
    generator = torch.Generator(device="cuda").manual_seed(2)
    q13, s13, q2, s2 = _fp8_experts(generator)
    x = torch.randn(tokens, 4096, device="cuda", generator=generator).to(torch.bfloat16)
    weights, ids = fused_moe.route_top_k(torch.randn(tokens, 8, device="cuda", generator=generator), 2)
    assert not fused_moe_kernels.takes_gemv(tokens, 2, 8, fp8=True)
    got = fused_moe_kernels.fused_experts(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2).float()
    want = _w8a8_reference(x, q13, s13, q2, s2, weights, ids)
    w8a16 = fused_moe.fused_experts_reference(x.float(), q13.float() * s13[..., None], q2.float() * s2[..., None],
                                              weights, ids)
    error = ((got - want).norm() / want.norm()).item()
    fp8_rows_error = ((got - w8a16).norm() / w8a16.norm()).item()
    print(f"{tokens} tokens: W8A8 off its PyTorch arithmetic by {error:.4f}, off the bf16-row result by "
          f"{fp8_rows_error:.4f} (relative L2)")
    # Not bit-identical: the tensor cores keep ~14 bits of the running sums of 64+-row tiles (measured 1.8% at 300
    # tokens; 0.2% at 40, whose 16-row tiles sum in float32), and the gate/up sums, in another order, round a few
    # activated values to the other side of a step of FP8 when they are quantized.
    assert error <= 0.03
    assert fp8_rows_error <= 0.07  # two more FP8 roundings (~3.6% RMS each) than the bf16-row result


@pytest.mark.parametrize("tokens", [2, 16])  # the GEMVs, the grouped GEMM
def test_kernel_replays_in_a_cuda_graph_with_new_routing(tokens):
    w13, w2, generator = _experts(256, 128, 8, torch.bfloat16)
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16, generator=generator)
    logits = torch.randn(tokens, 8, device="cuda", generator=generator)

    def step():
        weights, ids = fused_moe.route_top_k(logits, 2)
        return fused_moe_kernels.fused_experts(x, w13, w2, weights, ids)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16, generator=generator))
    logits.copy_(torch.randn(tokens, 8, device="cuda", generator=generator))
    graph.replay()
    torch.testing.assert_close(out, step(), atol=0, rtol=0)


def test_tiny_mixtral_on_the_gpu_matches_hf(tmp_path, engine_config):
    from transformers import AutoModelForCausalLM

    from treadle import Engine, SamplingParams
    from treadle.testing.models import make_tiny_mixtral

    path = make_tiny_mixtral(tmp_path / "mixtral")
    prompts = [[5, 17, 42, 8, 99, 3, 250, 11], [300, 301, 9]]
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected = [hf_model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                      pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    engine = Engine(engine_config(path, "triton", "float32"))
    outputs = engine.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=12, temperature=0.0,
                                                                                ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected


@pytest.mark.parametrize("source", ["fp8_checkpoint", "quantize_at_load"])
def test_fp8_mixtral_serves_with_fp8_experts(tmp_path, engine_config, source):
    """A tiny FP8 Mixtral checkpoint (attention and experts FP8, as on the hub), or a bf16 one with
    ``model.quantization: fp8``, through the Engine: the experts are FP8 and greedy tokens are the same with CUDA
    graphs on and off."""
    from treadle import Engine, SamplingParams
    from treadle.testing.models import make_tiny_fp8_mixtral, make_tiny_mixtral

    if source == "fp8_checkpoint":
        path = make_tiny_fp8_mixtral(tmp_path / "fp8")
    else:
        path = make_tiny_mixtral(tmp_path / "bf16")
    prompts = [[5, 17, 42, 8, 99, 3, 250, 11], [300, 301, 9], [7] * 30]
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = []
    for graphs in (False, True):
        config = engine_config(path, "triton", "bfloat16", graphs=graphs)
        if source == "quantize_at_load":
            config["model"]["quantization"] = "fp8"
        engine = Engine(config)
        try:
            moe = [m for m in engine.scheduler.worker.runner.model.modules() if type(m).__name__ == "FusedExperts"]
            assert moe and all(m.gate_up_proj.dtype == torch.float8_e4m3fn for m in moe)
            tokens.append([o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)])
        finally:
            engine.shutdown()
    assert tokens[0] == tokens[1] and all(len(t) == 12 for t in tokens[0])


def test_qwen3_moe_prefills_whole_chunks_through_graphs_with_the_eager_tokens(tmp_path, engine_config):
    """Qwen3-MoE declares its prefill launch-bound and prefers mixed chunks, so on CUDA ``enable_mixed_chunk: auto``
    is on and ``piecewise_cuda_graph_max_tokens: auto`` covers its largest extend step (a 2048-token chunk plus the
    decode rows beside it) rather than 1024; in float32 a 1500-token prompt's greedy tokens are the eager ones."""
    from treadle import Engine, SamplingParams
    from treadle.testing.models import make_tiny_qwen3_moe

    path = make_tiny_qwen3_moe(tmp_path / "qwen3moe", max_position_embeddings=2048)
    prompts = [torch.randint(3, 500, (1500,), generator=torch.Generator().manual_seed(0)).tolist(), [300, 301, 9]]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {}
    for piecewise in ("auto", 0):
        config = engine_config(path, "triton", "float32")
        config["scheduler"]["chunked_prefill_size"] = 2048
        config["runtime"]["piecewise_cuda_graph_max_tokens"] = piecewise
        engine = Engine(config)
        try:
            resolved = engine.scheduler.config
            assert resolved.scheduler.enable_mixed_chunk is True
            assert resolved.runtime.piecewise_cuda_graph_max_tokens == (0 if piecewise == 0 else 2048 + 16)
            tokens[piecewise] = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
        finally:
            engine.shutdown()
    assert tokens["auto"] == tokens[0]
