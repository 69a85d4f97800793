"""FP8 on a GPU with FP8 tensor cores: the linear kernels against bfloat16, FP8 models/KV under CUDA graphs,
and the attention conformance kit over an FP8 KV cache."""

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


@pytest.mark.parametrize("rows", [1, 7, 16, 20, 33, 256])
@pytest.mark.parametrize("n, k", SHAPES)
def test_fp8_linear_is_close_to_bf16(n, k, rows):
    from treadle.kernels.fp8_ops import fp8_matmul, quantize_per_channel, quantize_per_token

    gen = torch.Generator(device=DEVICE).manual_seed(n + k + rows)
    weight = (torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(rows, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    reference = x @ weight.t()
    wq, ws = quantize_per_channel(weight)
    w8a8 = fp8_matmul(*quantize_per_token(x), wq, ws, torch.bfloat16)
    assert w8a8.dtype == torch.bfloat16 and _relative_error(w8a8, reference) < 0.05
    if rows <= 32:
        from treadle.kernels.small_batch import FP8_CONFIGS, SIXTEEN_BIT_CONFIGS, small_batch_matmul

        for config in FP8_CONFIGS:
            y = small_batch_matmul(x, wq, ws, config)
            assert _relative_error(y, reference) < (0.05 if config.w8a8 else 0.04), config
            if config.w8a8:  # the same FP8 rows as cuBLAS's: the sums as precise as its (~0.1%: bf16 outputs)
                error = _relative_error(y, w8a8)
                print(f"{n} x {k}, {rows} rows, {config}: off cuBLAS by {error:.4f}")
                assert error < 2e-3, config  # without promoting the tensor cores' sums: 2.4e-3 at K=4096
        for config in SIXTEEN_BIT_CONFIGS:  # the same kernel on the bf16 weight: as close as cuBLAS
            assert _relative_error(small_batch_matmul(x, weight, None, config), reference) < 0.01, config


@pytest.mark.parametrize("rows", [1, 16, 32])
def test_split_k_matmul_replayed_from_a_graph_matches_eager(rows):
    """The split-K configs' last-arriving program sums the partials: replayed back to back from a CUDA graph,
    every call gives the eager result bit for bit and leaves the counts at zero."""
    from treadle.kernels.fp8_ops import quantize_per_channel
    from treadle.kernels.small_batch import FP8_CONFIGS, _arrival_counts, small_batch_matmul

    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    wq, ws = quantize_per_channel((torch.randn(4096, 14336, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16))
    x = torch.randn(rows, 14336, device=DEVICE, generator=gen).to(torch.bfloat16)
    configs = [config for config in FP8_CONFIGS if config.split_k > 1]
    eager = [small_batch_matmul(x, wq, ws, config) for config in configs]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = [small_batch_matmul(x, wq, ws, config) for config in configs for _ in range(3)]
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    for index, config in enumerate(configs):
        for out in graphed[3 * index: 3 * index + 3]:
            assert torch.equal(out, eager[index]), config
    assert all(int(counts.count_nonzero()) == 0 for counts in _arrival_counts.values())


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_gemv_with_the_norm_after_it_matches_the_separate_kernels(weights):
    """One row through every GEMV config with ``add_rmsnorm``: the residual sum is the separate add's bit for bit,
    the norm within a bfloat16 rounding of the separate kernel's (its float32 sum of squares may add in another
    order); replayed from a CUDA graph, the same again, and the counters left at zero."""
    from treadle.kernels.fp8_ops import quantize_per_channel
    from treadle.kernels.fused_ops import add_rmsnorm
    from treadle.kernels.small_batch import (
        FP8_CONFIGS, SIXTEEN_BIT_CONFIGS, _arrival_counts, small_batch_matmul)

    gen = torch.Generator(device=DEVICE).manual_seed(7)
    dense = (torch.randn(4096, 4096, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16)
    weight, scale = quantize_per_channel(dense) if weights == "fp8" else (dense, None)
    configs = [c for c in (FP8_CONFIGS if weights == "fp8" else SIXTEEN_BIT_CONFIGS) if c.gemv]
    x = torch.randn(1, 4096, device=DEVICE, generator=gen).to(torch.bfloat16)
    residual = torch.randn(1, 4096, device=DEVICE, generator=gen).to(torch.bfloat16)
    norm_weight = (torch.rand(4096, device=DEVICE, generator=gen) + 0.5).to(torch.bfloat16)
    for config in configs:
        expected_normed, expected_sum = add_rmsnorm(small_batch_matmul(x, weight, scale, config), residual,
                                                    norm_weight, 1e-5)
        normed, summed = small_batch_matmul(x, weight, scale, config, add_rmsnorm=(residual, norm_weight, 1e-5))
        assert torch.equal(summed, expected_sum), config
        assert torch.allclose(normed.float(), expected_normed.float(), rtol=2**-7, atol=1e-6), config
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = small_batch_matmul(x, weight, scale, config, add_rmsnorm=(residual, norm_weight, 1e-5))
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed[0], normed) and torch.equal(replayed[1], summed), config
    assert all(int(counts.count_nonzero()) == 0 for counts in _arrival_counts.values())


def test_per_token_quant_kernel_matches_torch_rounding():
    from treadle.core.loading.quantization import FP8_DTYPE, FP8_MAX
    from treadle.kernels.fp8 import per_token_quant

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


def _prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 8000 + 3 for j in range(20 + 9 * i)] for i in range(5)]


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
@pytest.mark.parametrize("fp8", [{"model": {"quantization": "fp8"}}, {"cache": {"kv_dtype": "fp8_e4m3"}},
                                 {"model": {"quantization": "fp8", "quantize_lm_head": False}},
                                 {"model": {"quantization": "fp8", "lm_head_exact_top": 0}}],
                         ids=["fp8-weights", "fp8-kv-cache", "fp8-weights-16-bit-head", "fp8-weights-plain-fp8-head"])
def test_fp8_gives_the_same_tokens_with_and_without_cuda_graphs(real_shape_llama_dir, engine_config, backend, fp8):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    eager = _greedy(real_shape_llama_dir, engine_config, backend, False, **fp8)
    graphed = _greedy(real_shape_llama_dir, engine_config, backend, True, **fp8)
    assert eager == graphed and all(len(tokens) == 12 for tokens in eager)


def test_the_fp8_heads_greedy_tokens_are_the_16_bit_heads(real_shape_llama_dir, engine_config):
    """FP8 weights with the default FP8 head (each row's 8 best logits recomputed from the 16-bit weight) pick the
    tokens the 16-bit head picks over the same FP8 decoder, under CUDA graphs."""
    sixteen_bit = _greedy(real_shape_llama_dir, engine_config, "triton", True,
                          model={"quantization": "fp8", "quantize_lm_head": False})
    default = _greedy(real_shape_llama_dir, engine_config, "triton", True, model={"quantization": "fp8"})
    plain = _greedy(real_shape_llama_dir, engine_config, "triton", True,
                    model={"quantization": "fp8", "lm_head_exact_top": 0})
    print(f"prompts identical to the 16-bit head's: recomputed {sum(a == b for a, b in zip(default, sixteen_bit))}"
          f" / 5, plain FP8 head {sum(a == b for a, b in zip(plain, sixteen_bit))} / 5")
    assert default == sixteen_bit


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_exact_top_logits_at_llama_3_vocabulary(rows):
    """The two recompute kernels on an FP8 head of Llama-3.1-8B's shape (128256 x 4096): each row's 8 best FP8
    logits (ties to the lower column) become the bf16 head's within one bf16 step; nothing else moves."""
    from treadle.layers.exact_top_logits import recompute_top_logits
    from treadle.kernels.fp8_ops import fp8_matmul, quantize_per_channel, quantize_per_token

    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    weight = (torch.randn(128256, 4096, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(rows, 4096, device=DEVICE, generator=gen).to(torch.bfloat16)
    wq, ws = quantize_per_channel(weight)
    approximate = fp8_matmul(*quantize_per_token(x), wq, ws, torch.bfloat16)
    logits = approximate.clone()
    recompute_top_logits(logits, x, weight, 8)
    exact = (x.float() @ weight.float().t()).to(torch.bfloat16)
    best = torch.sort(-approximate.float(), dim=-1, stable=True).indices[:, :8]
    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, best, True)
    assert torch.equal(logits[~chosen], approximate[~chosen])
    assert torch.allclose(logits[chosen].float(), exact[chosen].float(), rtol=2**-7, atol=0)
    assert not torch.equal(logits[chosen], approximate[chosen])


# Like test_attention_conformance_gpu.py: GQA 32/8 heads of 128 dims, requests up to 3000 tokens.
KIT_REAL = dict(num_heads=32, num_kv_heads=8, head_dim=128, max_seq_len=3000, batch_size=6, sliding_window=1024)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_fp8_kv_cache_with_scales_attends_exactly_like_torch_native_over_16_bits(backend):
    """The conformance kit over an FP8 KV cache (k_scale 0.5, v_scale 2): K/V values exact in both FP8 and
    bfloat16, so the backend must match torch_native over a bfloat16 cache within bfloat16 tolerances,
    extend, decode and CUDA-graph decode; tests/test_conformance_kit_attention.py runs the same on the CPU."""
    from treadle.testing import check_attention_backend

    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
        from treadle.plugins.attention.flashinfer import FlashInferAttnBackend as factory
    else:
        from treadle.plugins.attention.triton.backend import TritonAttnBackend as factory
    check_attention_backend(factory, "cuda", torch.bfloat16, kv_dtype=torch.float8_e4m3fn, kv_scales=(0.5, 2.0),
                            **KIT_REAL)


def test_one_kernel_kv_write_matches_the_torch_path():
    """kernels/kv_store.py on the GPU, FP8 caches with and without a scale included (the CPU test runs 16/32-bit
    caches under the Triton interpreter, whose FP8 conversion does not round to nearest)."""
    import subprocess
    import sys

    from kv_store_checks import CHECKS

    proc = subprocess.run([sys.executable, "-c", CHECKS, "cuda"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
def test_fused_silu_mul_equals_the_matmul_then_silu_mul(weights):
    """A gated MLP's ``gate_up_proj`` with ``silu_mul`` in its kernel (the one-token GEMV, and the tl.dot tiles at
    20 and 32 rows): the same bits as the kernel's output through the separate ``silu_mul`` kernel
    (Llama-3.1-8B's 28672 x 4096 and a ragged 2 x 1000 x 4096)."""
    from treadle.kernels.fp8_ops import quantize_per_channel
    from treadle.kernels.fused import silu_mul
    from treadle.kernels.small_batch import (FP8_CONFIGS, SIXTEEN_BIT_CONFIGS, fuses_silu_mul,
                                                          small_batch_matmul)

    for n, k in ((28672, 4096), (2000, 4096)):
        gen = torch.Generator(device=DEVICE).manual_seed(n)
        weight = (torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16)
        inputs = torch.randn(32, k, device=DEVICE, generator=gen).to(torch.bfloat16)
        weight, scale, configs = (weight, None, SIXTEEN_BIT_CONFIGS) if weights == "bf16" else (
            *quantize_per_channel(weight), FP8_CONFIGS)
        for config in filter(fuses_silu_mul, configs):
            for rows in (1,) if config.gemv else (20, 32):
                x = inputs[:rows]
                fused = small_batch_matmul(x, weight, scale, config, silu_mul=True)
                assert torch.equal(fused, silu_mul(small_batch_matmul(x, weight, scale, config))), (config, rows)


def test_l2_prefetch_changes_no_result():
    """Asking L2 for the next layer's weight as a kernel finishes is invisible in its output: the GEMV (with the
    norm after it, and with SiLU·mul), the tl.dot tiles and split-K, eagerly and replayed from a CUDA graph."""
    from treadle.layers.small_batch import l2_prefetch_bytes
    from treadle.kernels.small_batch import SIXTEEN_BIT_CONFIGS, small_batch_matmul

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    weight, following = (torch.randn(2, 4096, 4096, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16)
    prefetch = l2_prefetch_bytes(following, 8 << 20)
    assert prefetch is not None and prefetch.numel() == 8 << 20 and prefetch.data_ptr() == following.data_ptr()
    x = torch.randn(32, 4096, device=DEVICE, generator=gen).to(torch.bfloat16)
    residual, norm_weight = x[:1] * 0.5, torch.rand(4096, device=DEVICE, generator=gen).to(torch.bfloat16) + 0.5
    cases = []
    for config in SIXTEEN_BIT_CONFIGS:
        for rows in (1,) if config.gemv else (3, 32):
            cases.append((x[:rows], config, {}))
            if config.gemv and config.split_k == 1:
                cases += [(x[:1], config, {"silu_mul": True}),
                          (x[:1], config, {"add_rmsnorm": (residual, norm_weight, 1e-5)})]
    expected = [small_batch_matmul(rows, weight, None, config, **options) for rows, config, options in cases]
    eager = [small_batch_matmul(rows, weight, None, config, prefetch=prefetch, **options)
             for rows, config, options in cases]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = [small_batch_matmul(rows, weight, None, config, prefetch=prefetch, **options)
                    for rows, config, options in cases]
    graph.replay()
    torch.cuda.synchronize()
    for want, *got in zip(expected, eager, replayed):
        for result in got:
            pairs = zip(want, result) if isinstance(want, tuple) else [(want, result)]
            assert all(torch.equal(a, b) for a, b in pairs)
