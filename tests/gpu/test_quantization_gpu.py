"""Integer weights on a GPU: the Triton kernels of kernels/packed_int.py at Llama-3.1-8B's projection shapes against
the dequantized matmul, and quantized checkpoints (GPTQ act-order, AWQ, compressed-tensors W4A16/W8A16) served
under CUDA graphs with the greedy tokens of the same model's dequantized weights."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEVICE = torch.device("cuda")
# Llama-3.1-8B's projections: qkv, o, gate_up, down.
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
QUANTIZATION_PLUGINS = [f"treadle.plugins.quantization.{name}" for name in ("gptq", "awq", "compressed_tensors")]


def _reference(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, groups: torch.Tensor,
               bits: int) -> torch.Tensor:
    zero = (1 << (bits - 1)) if zeros is None else zeros.float()[:, groups]
    return (values.float() - zero) * scales.float()[:, groups]


@pytest.mark.parametrize("bits, group, asym, act_order", [(4, 128, False, False), (4, 128, True, False),
                                                          (4, 32, True, False), (8, 128, False, False),
                                                          (4, 128, False, True)])
@pytest.mark.parametrize("n, k", SHAPES)
def test_int_kernels_match_the_dequantized_matmul(n, k, bits, group, asym, act_order):
    from treadle.kernels.int_kernel_plan import plan_kernels
    from treadle.layers.packed_int import pack_panels

    gen = torch.Generator(device=DEVICE).manual_seed(n + k + bits + group)
    values = torch.randint(0, 1 << bits, (n, k), device=DEVICE, generator=gen)
    scales = (torch.rand(n, k // group, device=DEVICE, generator=gen) * 0.002 + 0.001).to(torch.bfloat16)
    zeros = torch.randint(0, 1 << bits, (n, k // group), device=DEVICE, generator=gen).to(torch.bfloat16) \
        if asym else None
    groups = torch.arange(k, device=DEVICE) // group
    if act_order:
        groups = groups[torch.randperm(k, device=DEVICE, generator=gen)].sort().values
    weight = _reference(values, scales, zeros, groups, bits)
    packed = pack_panels(values, bits)
    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    plan = plan_kernels(n, k, bits, group, sm_count, dtype=torch.bfloat16)  # magic_mma where it applies
    for rows in (1, 7, 16, 32, 40, 200, 600):
        x = torch.randn(rows, k, device=DEVICE, generator=gen).to(torch.bfloat16)
        expected = x.float() @ weight.t()
        y = plan.run(x, packed, scales, zeros, groups.to(torch.int32) if act_order else None)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        error = ((y.float() - expected).norm() / expected.norm()).item()
        assert error < 1e-2, (rows, error)


@pytest.mark.parametrize("group, asym", [(128, False), (32, True)])
def test_int_mma_candidates_match_the_dequantized_matmul(group, asym):
    # kernels/packed_int_mma.py's kernel families on the real compiler (wgmma from registers, whole-panel reshapes
    # through shared memory), at 1 to 64 rows; the sweep also checks every candidate at the four shapes.
    from treadle.kernels.packed_int_mma import MmaTiles, int_mma
    from treadle.layers.packed_int import pack_panels

    n, k = 4096, 4096
    gen = torch.Generator(device=DEVICE).manual_seed(group)
    values = torch.randint(0, 16, (n, k), device=DEVICE, generator=gen)
    scales = (torch.rand(n, k // group, device=DEVICE, generator=gen) * 0.002 + 0.001).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // group), device=DEVICE, generator=gen).to(torch.bfloat16) if asym else None
    weight = _reference(values, scales, zeros, torch.arange(k, device=DEVICE) // group, 4)
    packed = pack_panels(values, 4)
    families = [MmaTiles(16, 128, per_slot=True, split_k=4, num_stages=5),
                MmaTiles(64, 256, per_slot=True, num_warps=8), MmaTiles(32, 64, 2, scale_in_regs=True), MmaTiles(16, 64, 2, 2, swap=False, scale_in_regs=True),
                MmaTiles(16, 128, split_k=2), MmaTiles(64, 64, swap=False)]
    for tiles in [t for t in families if t.fits(k, 4, group)]:
        for rows in (1, 5, 40):
            x = torch.randn(rows, k, device=DEVICE, generator=gen).to(torch.bfloat16)
            expected = x.float() @ weight.t()
            error = ((int_mma(x, packed, scales, zeros, 4, group, tiles).float() - expected).norm()
                     / expected.norm()).item()
            assert error < 1e-2, (tiles, rows, error)


@pytest.mark.parametrize("asym", [False, True])
def test_one_token_gate_up_computes_silu_mul_in_the_gemv(asym):
    from treadle.kernels.fused_ops import silu_mul
    from treadle.kernels.packed_int import gemv_candidates, int_gemv
    from treadle.layers.packed_int import pack_panels

    n, k = 28672, 4096  # Llama-3.1-8B's gate_up_proj
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    values = torch.randint(0, 16, (n, k), device=DEVICE, generator=gen)
    scales = (torch.rand(n, k // 128, device=DEVICE, generator=gen) * 0.002 + 0.001).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // 128), device=DEVICE, generator=gen).to(torch.bfloat16) if asym else None
    packed = pack_panels(values, 4)
    x = torch.randn(1, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for tiles in [t for t in gemv_candidates(n, k, 4, sm_count) if t.split_k == 1]:
        fused = int_gemv(x, packed, scales, zeros, 4, 128, tiles, silu_mul=True)
        separate = silu_mul(int_gemv(x, packed, scales, zeros, 4, 128, tiles))
        assert torch.allclose(fused.float(), separate.float(), rtol=2**-7, atol=1e-5), tiles


@pytest.mark.parametrize("n, k", [(4096, 14336), (6144, 4096)])
def test_every_launch_config_the_loader_may_time_is_correct(n, k):
    from treadle.kernels.int_kernel_plan import batch_candidates, run_tiles
    from treadle.kernels.packed_int import gemv_candidates
    from treadle.layers.packed_int import pack_panels

    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    values = torch.randint(0, 16, (n, k), device=DEVICE, generator=gen)
    scales = (torch.rand(n, k // 128, device=DEVICE, generator=gen) * 0.002 + 0.001).to(torch.bfloat16)
    weight = _reference(values, scales, None, torch.arange(k, device=DEVICE) // 128, 4)
    packed = pack_panels(values, 4)
    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for rows, candidates in [(1, gemv_candidates(n, k, 4, sm_count))] + \
            [(rows + 3, batch_candidates(n, k, 4, 128, rows, sm_count, torch.bfloat16)) for rows in (16, 32, 64)]:
        for tiles in candidates:
            x = torch.randn(rows, k, device=DEVICE, generator=gen).to(torch.bfloat16)
            y = run_tiles(x, packed, scales, None, 4, 128, tiles)
            expected = x.float() @ weight.t()
            assert ((y.float() - expected).norm() / expected.norm()).item() < 1e-2, tiles


@pytest.mark.parametrize("method, settings", [("gptq", dict(act_order=True, group_size=128)),
                                              ("awq", dict(group_size=128)),
                                              ("compressed-tensors", dict(group_size=128)),
                                              ("compressed-tensors", dict(bits=8, group_size=-1))])
def test_quantized_checkpoint_generates_the_dequantized_models_tokens(tmp_path, real_shape_llama_dir, engine_config,
                                                                     method, settings):
    from treadle.core.engine import Engine
    from treadle.testing.quantized_models import make_tiny_quantized

    if method == "compressed-tensors":
        pytest.importorskip("compressed_tensors")  # the independent writer of its formats

    def make(path, seed=0):
        return real_shape_llama_dir

    quantized, dequantized = make_tiny_quantized(tmp_path, method, make, **settings)
    prompts = [[5, 17, 99, 250, 7, 300, 12, 44], [8, 200, 201, 202, 203, 204], [42, 43]]
    params = {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    outputs = []
    for folder in (dequantized, quantized):
        config = {**engine_config(folder, "triton", "bfloat16"), "plugins": QUANTIZATION_PLUGINS}
        with Engine(config) as engine:
            layer = engine.scheduler.worker.runner.model.model.layers[0].mlp.down_proj \
                if folder == quantized else None
            if layer is not None:
                assert layer.weight.dtype == torch.int32 and layer.int_kernels is not None
            outputs.append([out.token_ids for out in engine.generate(input_ids=prompts, sampling_params=params)])
            # One request alone: the one-token GEMVs with the next norm in their epilogue, the FP8 lm_head.
            outputs[-1] += [out.token_ids for out in engine.generate(input_ids=prompts[:1], sampling_params=params)]
    # Same weights up to bf16 rounding of the dequantized copy: the first tokens agree.
    assert [ids[:8] for ids in outputs[0]] == [ids[:8] for ids in outputs[1]]


@pytest.mark.parametrize("n, k", [(4096, 4096), (4096, 14336)])  # o_proj, down_proj: a norm follows each
def test_one_token_gemv_adds_the_residual_and_norms_in_its_epilogue(n, k):
    from treadle.kernels.fused_ops import add_rmsnorm
    from treadle.kernels.int_kernel_plan import plan_kernels
    from treadle.layers.packed_int import pack_panels

    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    values = torch.randint(0, 16, (n, k), device=DEVICE, generator=gen)
    scales = (torch.rand(n, k // 128, device=DEVICE, generator=gen) * 0.002 + 0.001).to(torch.bfloat16)
    packed = pack_panels(values, 4)
    plan = plan_kernels(n, k, 4, 128, torch.cuda.get_device_properties(DEVICE).multi_processor_count,
                        dtype=torch.bfloat16)
    assert plan.gemv.subnormal
    x = torch.randn(1, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    residual = torch.randn(1, n, device=DEVICE, generator=gen).to(torch.bfloat16)
    norm_weight = (torch.rand(n, device=DEVICE, generator=gen) + 0.5).to(torch.bfloat16)
    for _ in range(3):  # the counters reset for the next call
        normed, summed = plan.run_add_rmsnorm(x, packed, scales, None, residual, norm_weight, 1e-5)
        expected_normed, expected_sum = add_rmsnorm(plan.run(x, packed, scales, None, None), residual.clone(),
                                                    norm_weight, 1e-5)
        assert torch.allclose(summed.float(), expected_sum.float(), rtol=2**-8, atol=1e-6)
        assert torch.allclose(normed.float(), expected_normed.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("tokens", [1, 3, 64, 600])  # the GEMVs, then grouped tiles of 16, 64 and 128 rows
@pytest.mark.parametrize("asym", [False, True])
def test_int4_experts_kernels_match_the_dequantizing_reference(tokens, asym):
    from treadle.kernels.packed_int_moe import fused_int_experts

    packed, layer, x, weights, ids = _int4_experts(tokens, asym)
    got = fused_int_experts(x, packed["gate_up_proj"], packed["gate_up_scales"], packed["gate_up_zeros"],
                            packed["down_proj"], packed["down_scales"], packed["down_zeros"], weights, ids, 4, 128)
    assert _relative_error(got, layer, x, weights, ids) < 2e-2


@pytest.mark.parametrize("tokens", [64, 600])
@pytest.mark.parametrize("asym", [False, True])
def test_every_grouped_form_of_int4_experts_matches_the_reference(tokens, asym):
    # The magic-widening grouped GEMM (every launch the benchmark times, at 600 tokens), the slot-widening one, and
    # the experts dequantized into a scratch for the 16-bit grouped GEMM.
    from treadle.kernels.packed_int_moe import fused_int_experts
    from treadle.kernels.packed_int_moe_magic import magic_trials

    packed, layer, x, weights, ids = _int4_experts(tokens, asym)
    scratch = torch.empty(layer.num_experts * layer.down_proj.shape[2] * 8 * x.shape[1], dtype=x.dtype, device=DEVICE)
    runs = [("grouped", None), ("dequant", None), ("magic", None)]
    runs += [("magic", tiles) for tiles in magic_trials(tokens * 2, 8)] if tokens == 600 and not asym else []
    for form, tiles in runs:
        got = fused_int_experts(x, packed["gate_up_proj"], packed["gate_up_scales"], packed["gate_up_zeros"],
                                packed["down_proj"], packed["down_scales"], packed["down_zeros"], weights, ids, 4,
                                128, scratch, form=form, tiles=tiles)
        assert _relative_error(got, layer, x, weights, ids) < 2e-2, (form, tiles)


@pytest.mark.parametrize("tokens", [40, 100])
@pytest.mark.parametrize("form", ["grouped", "dequant", "magic"])
def test_every_grouped_form_of_panel_sized_int4_experts_matches_the_reference(tokens, form):
    # The tiny Mixtral's experts below (hidden 128: one panel, intermediate 256, 4 experts top-2).
    from treadle.kernels.packed_int_moe import fused_int_experts

    packed, layer, x, weights, ids = _int4_experts(tokens, False, experts=4, hidden=128, inter=256)
    scratch = torch.empty(4 * 256 * 128, dtype=x.dtype, device=DEVICE)
    got = fused_int_experts(x, packed["gate_up_proj"], packed["gate_up_scales"], packed["gate_up_zeros"],
                            packed["down_proj"], packed["down_scales"], packed["down_zeros"], weights, ids, 4, 128,
                            scratch, form=form)
    assert _relative_error(got, layer, x, weights, ids) < 2e-2


def test_int4_mixtral_generates_the_dequantized_models_tokens_through_every_experts_form(tmp_path, engine_config,
                                                                                        monkeypatch):
    # Panel-sized experts (hidden 128, intermediate 256, 4 experts top-2, groups of 128): a 100-token prefill runs
    # the dequant form (50 rows per expert, from 32 here), a 40-token one the magic grouped GEMM, decode steps the
    # GEMVs.
    import functools

    from near_tie import assert_greedy_under

    from treadle.core.engine import Engine
    from treadle.testing.models import make_tiny_mixtral
    from treadle.testing.quantized_models import make_tiny_quantized

    monkeypatch.setenv("TREADLE_INT_MOE_DEQUANT_ROWS", "32")
    make = functools.partial(make_tiny_mixtral, hidden_size=128, intermediate_size=256)
    quantized, dequantized = make_tiny_quantized(tmp_path, "gptq", make, group_size=128)
    prompts = [[(7 * i) % 500 + 3 for i in range(100)], [(11 * i) % 500 + 3 for i in range(40)], [42, 43]]
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    config = {**engine_config(quantized, "triton", "bfloat16"), "plugins": QUANTIZATION_PLUGINS}
    with Engine(config) as engine:
        layers = engine.scheduler.worker.runner.model.model.layers
        scratches = {id(layer.mlp.experts.dequant_scratch) for layer in layers}
        assert len(scratches) == 1 and layers[0].mlp.experts.dequant_scratch.numel() == 4 * 256 * 128
        outputs = [engine.generate(input_ids=[prompt], sampling_params=params)[0] for prompt in prompts]
    # Same weights (the dequantized copy rounds as the widening does), sums in another order: a token may swap with
    # a near-tied one (this random model's bf16 logits), so each is scored teacher-forced by the 16-bit model.
    config = {**engine_config(dequantized, "triton", "bfloat16"), "plugins": QUANTIZATION_PLUGINS}
    with Engine(config) as engine:
        assert_greedy_under(engine, prompts, outputs)


def _relative_error(got: torch.Tensor, layer, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> float:
    from treadle.layers.int_experts import fused_int_experts_reference

    expected = fused_int_experts_reference(x, layer, weights, ids)
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def _int4_experts(tokens: int, asym: bool, experts: int = 8, hidden: int = 4096, inter: int = 1792):
    # Default: Mixtral-8x7B's experts at tp=8 (a smaller intermediate).
    from types import SimpleNamespace

    from treadle.layers.packed_int import IntWeightScheme, pack_panels

    top_k = 2
    gen = torch.Generator(device=DEVICE).manual_seed(tokens)
    packed = {}
    for name, (n, k) in {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}.items():
        values = torch.randint(0, 16, (experts, n, k), device=DEVICE, generator=gen)
        packed[f"{name}_proj"] = torch.stack([pack_panels(v, 4) for v in values])
        packed[f"{name}_scales"] = (torch.rand(experts, n, k // 128, device=DEVICE, generator=gen) * 0.002
                                    + 0.001).to(torch.bfloat16)
        packed[f"{name}_zeros"] = torch.randint(0, 16, (experts, n, k // 128), device=DEVICE, generator=gen).to(
            torch.bfloat16) if asym else None
    layer = SimpleNamespace(int_scheme=IntWeightScheme(4, 128), int_group=128, panels=True, num_experts=experts,
                            **packed)
    x = torch.randn(tokens, hidden, device=DEVICE, generator=gen).to(torch.bfloat16)
    weights, ids = torch.rand(tokens, experts, device=DEVICE, generator=gen).softmax(-1).topk(top_k)
    return packed, layer, x, weights, ids


def test_the_l2_prefetch_of_the_next_weight_changes_no_result():
    # The GEMV (its epilogues too, split-K included) and magic_mma with the next weight's head asked of L2
    # (layer.l2_prefetch, as the model chains it): the same bits as without.
    from treadle.kernels.int_kernel_plan import plan_kernels
    from treadle.layers.packed_int import pack_panels
    from treadle.layers.small_batch import l2_prefetch_bytes

    gen = torch.Generator(device=DEVICE).manual_seed(11)
    following = torch.randint(-2**31, 2**31 - 1, (4096, 14336 // 8), dtype=torch.int32, device=DEVICE)
    head = l2_prefetch_bytes(following, 8 << 20)
    assert head is not None
    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for n, k in ((28672, 4096), (4096, 4096)):  # gate_up_proj (no split-K: silu_mul fuses), o_proj (split-K)
        packed = pack_panels(torch.randint(0, 16, (n, k), device=DEVICE, generator=gen), 4)
        scales = (torch.rand(n, k // 128, device=DEVICE, generator=gen) * 0.002 + 0.001).to(torch.bfloat16)
        plan = plan_kernels(n, k, 4, 128, sm_count, dtype=torch.bfloat16)
        for rows in (1, 16, 32):
            x = torch.randn(rows, k, device=DEVICE, generator=gen).to(torch.bfloat16)
            assert torch.equal(plan.run(x, packed, scales, None, None, head), plan.run(x, packed, scales, None, None))
        x = x[:1]
        if n == 28672:
            assert plan.gemv.split_k == 1
            assert torch.equal(plan.run_silu_mul(x, packed, scales, None, head),
                               plan.run_silu_mul(x, packed, scales, None))
            continue
        assert plan.gemv.split_k > 1
        residual = torch.randn(1, n, device=DEVICE, generator=gen).to(torch.bfloat16)
        norm_weight = torch.ones(n, device=DEVICE, dtype=torch.bfloat16)
        with_head = plan.run_add_rmsnorm(x, packed, scales, None, residual, norm_weight, 1e-5, head)
        without = plan.run_add_rmsnorm(x, packed, scales, None, residual, norm_weight, 1e-5)
        assert all(torch.equal(a, b) for a, b in zip(with_head, without))


@pytest.mark.parametrize("bits, group, asym, uneven", [(4, 128, False, False), (4, 128, True, False),
                                                       (4, 32, True, False), (8, 64, True, False),
                                                       (4, 128, True, True)])
def test_dequantize_gives_the_reference_weight_bit_for_bit(bits, group, asym, uneven):
    # kernels/packed_int_dequant.py: (u - zero) * scale in float32 rounded once to bf16, as the torch reference; a
    # ragged N (rows past the last tile) and a K whose panels do not split evenly among the programs (5 of 4).
    from treadle.kernels.packed_int_dequant import DequantTiles, dequantize, dequantize_candidates
    from treadle.layers.packed_int import pack_panels

    n, k = 200, 5 * 512 // bits
    gen = torch.Generator(device=DEVICE).manual_seed(bits + group)
    values = torch.randint(0, 1 << bits, (n, k), device=DEVICE, generator=gen)
    scales = (torch.rand(n, k // group, device=DEVICE, generator=gen) * 0.002 + 0.001).to(torch.bfloat16)
    zeros = torch.randint(0, 1 << bits, (n, k // group), device=DEVICE, generator=gen).to(torch.bfloat16) \
        if asym else None
    groups = torch.arange(k, device=DEVICE) // group
    if uneven:  # act-order on a row-parallel rank: sorted, but groups of any size
        groups = torch.randint(0, k // group, (k,), device=DEVICE, generator=gen).sort().values
    expected = _reference(values, scales, zeros, groups, bits).to(torch.bfloat16)
    g_idx = groups.to(torch.int32) if uneven else None
    configs = dequantize_candidates()[:3] + [DequantTiles(64, 8, 8)] if group == 128 and not asym else [DequantTiles()]
    for tiles in configs:
        got = dequantize(pack_panels(values, bits), scales, zeros, g_idx, bits, group, torch.bfloat16, tiles=tiles)
        assert torch.equal(got, expected), tiles
