"""The one-token MLP-step kernel (``decode_mlp_kernels``) on a GPU: its one-launch form with grid-wide waits
against its three-launch form and the separate kernels, under CUDA graphs, and in a model."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

DEVICE = torch.device("cuda")


def _relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y.float() - reference.float()).norm() / reference.float().norm()).item()


def _weights(kind: str, hidden: int = 4096, k_o: int = 4096, inter: int = 14336):
    from treadle.plugins.models.decode_mlp_kernels import DecodeMlpWeights
    from treadle.plugins.models.fp8_ops import quantize_per_channel

    gen = torch.Generator(device=DEVICE).manual_seed(3)
    dense = [(torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).to(torch.bfloat16)
             for n, k in ((hidden, k_o), (2 * inter, hidden), (hidden, inter))]
    norms = [(torch.rand(hidden, device=DEVICE, generator=gen) + 0.5).to(torch.bfloat16) for _ in range(2)]
    parts = [quantize_per_channel(d) if kind == "fp8" else (d, None) for d in dense]
    return DecodeMlpWeights(parts[0][0], parts[0][1], norms[0], 1e-5, parts[1][0], parts[1][1], parts[2][0],
                            parts[2][1], norms[1], 1e-5)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 weights need compute capability 8.9+")
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_one_launch_equals_three_launches_and_the_separate_kernels(kind):
    """Llama-3.1-8B's sizes: the one-launch form (grid-wide waits) gives the three-launch form's result bit for
    bit, eagerly and replayed from a CUDA graph (with the L2 prefetch of the next weight); it is within bfloat16
    roundings of the separate GEMV kernels; the counters end at zero and no wait gave up."""
    from treadle.plugins.models.decode_mlp_kernels import counters, decode_mlp
    from treadle.plugins.models.fused_ops import add_rmsnorm, silu_mul
    from treadle.plugins.models.small_batch import l2_prefetch_bytes
    from treadle.plugins.models.small_batch_kernels import FP8_CONFIGS, SIXTEEN_BIT_CONFIGS, small_batch_matmul

    w = _weights(kind)
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    attended = torch.randn(1, 4096, device=DEVICE, generator=gen).to(torch.bfloat16)
    residual = torch.randn(1, 4096, device=DEVICE, generator=gen).to(torch.bfloat16)
    three = decode_mlp(attended, residual, w, persistent=False)
    one = decode_mlp(attended, residual, w, persistent=True)
    prefetch = l2_prefetch_bytes(w.o_proj, 8 << 20)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = decode_mlp(attended, residual, w, persistent=True, prefetch=prefetch)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for got in (one, replayed):
        assert all(torch.equal(a, b) for a, b in zip(got, three))
    assert int(counters(DEVICE).count_nonzero()) == 0

    gemv = next(c for c in (FP8_CONFIGS if kind == "fp8" else SIXTEEN_BIT_CONFIGS) if c.gemv and c.split_k == 1)
    normed, summed = add_rmsnorm(small_batch_matmul(attended, w.o_proj, w.o_scale, gemv), residual, w.post_norm,
                                 w.post_eps)
    act = silu_mul(small_batch_matmul(normed, w.gate_up, w.gate_up_scale, gemv))
    expected = add_rmsnorm(small_batch_matmul(act, w.down, w.down_scale, gemv), summed, w.next_norm, w.next_eps)
    assert _relative_error(three[0], expected[0]) < 1e-2 and _relative_error(three[1], expected[1]) < 1e-2


def test_a_model_decodes_one_request_the_same_with_and_without_it(real_shape_llama_dir, engine_config,
                                                                  monkeypatch):
    """One request (so one-token decode steps) runs the kernel, with the same greedy tokens eager and graphed
    (against the separate kernels, ``TREADLE_DECODE_MLP=0``, the sums add in another order: the kernel test above
    bounds the difference; greedy tokens on random weights may part after a few steps)."""
    from treadle.core.engine import Engine
    from treadle.plugins.models import decode_mlp_kernels

    calls = []
    run = decode_mlp_kernels.decode_mlp
    monkeypatch.setattr(decode_mlp_kernels, "decode_mlp", lambda *args, **kw: calls.append(1) or run(*args, **kw))

    def greedy(graphs: bool) -> list[int]:
        engine = Engine(engine_config(real_shape_llama_dir, "triton", "bfloat16", graphs=graphs))
        try:
            out = engine.generate(input_ids=[[(7 * j) % 8000 + 3 for j in range(37)]],
                                  sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
            return out[0].token_ids
        finally:
            engine.shutdown()

    fused_graphed, fused_eager = greedy(True), greedy(False)
    assert calls, "the layers did not choose the one-token kernel"
    assert fused_graphed == fused_eager and len(fused_graphed) == 16
    monkeypatch.setenv("TREADLE_DECODE_MLP", "0")
    separate = greedy(True)
    print("fused", fused_graphed, "separate", separate)
    assert separate[:2] == fused_graphed[:2]
