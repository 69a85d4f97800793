"""FP8 models on the CPU: quantize at load, FP8 checkpoints (per-tensor, per-channel, static), dequantize-on-load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from treadle.core.loading import quantization
from treadle.core.config import ModelConfig
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.loading.model_loader import ModelLoadError, load_model
from treadle.core.loading.quantization import FP8_DTYPE
from treadle.core.registry import build_registry
from treadle.kernels.fp8_ops import dequantize
from treadle.testing.models import make_tiny_fp8_llama, make_tiny_llama

TOKENS = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 128, 9]


@pytest.fixture(scope="module")
def registry():
    return build_registry(plugin_modules=["treadle.plugins.models.llama", "treadle.plugins.attention.torch_native"],
                          load_entry_points=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("fp8") / "bf")


def _load(registry, path: str, **fields):
    model, _, _ = load_model(ModelConfig(path=path, device="cpu", dtype="float32", **fields), registry)
    return model


class _NoCache:
    """Prefill-only attention without a KV pool: causal SDPA over the one sequence."""

    def applies_rotary(self, forward_batch) -> bool:
        return False

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        n = q.shape[0]
        q = q.view(n, layer.num_heads, layer.head_dim).transpose(0, 1)
        k = k.view(n, layer.num_kv_heads, layer.head_dim).transpose(0, 1)
        v = v.view(n, layer.num_kv_heads, layer.head_dim).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=layer.scaling, enable_gqa=True)
        return out.transpose(0, 1).reshape(n, -1)


def _logits(model) -> torch.Tensor:
    n = len(TOKENS)
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=torch.tensor(TOKENS),
        positions=torch.arange(n), req_pool_indices=torch.zeros(1, dtype=torch.int64),
        seq_lens=torch.tensor([n]), seq_lens_cpu=torch.tensor([n]), out_cache_loc=torch.arange(n),
        seq_lens_sum=n, logits_indices=torch.arange(n), req_to_token_pool=None, kv_cache=None,
        attn_backend=_NoCache(),
    )
    with torch.inference_mode():
        return model(batch.input_ids, batch.positions, batch)


def _fp8_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.dtype == FP8_DTYPE}


def test_quantize_at_load_makes_every_decoder_projection_fp8_and_stays_close(tiny, registry):
    reference = _logits(_load(registry, tiny))
    model = _load(registry, tiny, quantization="fp8", quantize_lm_head=False)
    fp8 = _fp8_params(model)
    assert len(fp8) == 2 * 4  # qkv, o, gate_up, down in each of the 2 layers
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32
    logits = _logits(model)
    assert 0 < _relative_rms_error(logits, reference) < 0.15  # about 0.09: two FP8 roundings per matmul


def _relative_rms_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    # A wrong scale or a transposed weight gives errors of the order of 1 or more.
    return ((logits - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()).item()


def test_quantize_lm_head_makes_the_output_projection_fp8_too(tiny, registry, tmp_path):
    reference = _logits(_load(registry, tiny))
    decoder_only = _load(registry, tiny, quantization="fp8", quantize_lm_head=False)
    model = _load(registry, tiny, quantization="fp8", quantize_lm_head=True, lm_head_exact_top=0)
    head = model.lm_head
    assert head.weight.dtype == FP8_DTYPE and head.weight_scale.shape == (head.weight.shape[0], 1)
    assert head.exact_weight is None  # nothing recomputed, so the 16-bit weight is not kept
    assert len(_fp8_params(model)) == 2 * 4 + 1
    expected = dequantize(head.weight, head.weight_scale, torch.float32)
    assert torch.allclose(expected, decoder_only.lm_head.weight, rtol=2**-3, atol=1e-6)  # one FP8 step per value
    logits = _logits(model)
    assert not torch.equal(logits, _logits(decoder_only))
    assert 0 < _relative_rms_error(logits, reference) < 0.2
    # A tied embedding keeps its 16-bit weight; the head gets its own FP8 copy.
    tied = make_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    model = _load(registry, tied, quantization="fp8", quantize_lm_head=True)
    assert model.lm_head.weight.dtype == FP8_DTYPE
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert _relative_rms_error(_logits(model), _logits(_load(registry, tied))) < 0.2
    # ... which is also the weight its best logits are recomputed from: no second 16-bit copy.
    assert model.lm_head.exact_weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_fp8_weights_get_an_fp8_head_whose_best_logits_are_the_16_bit_heads(tiny, registry):
    decoder_only = _load(registry, tiny, quantization="fp8", quantize_lm_head=False)
    plain_head = _load(registry, tiny, quantization="fp8", lm_head_exact_top=0)
    model = _load(registry, tiny, quantization="fp8")  # the defaults: an FP8 head, its 8 best logits recomputed
    assert model.lm_head.weight.dtype == FP8_DTYPE
    assert torch.equal(model.lm_head.exact_weight, decoder_only.lm_head.weight)
    logits, plain, reference = _logits(model), _logits(plain_head), _logits(decoder_only)
    best = plain.topk(8, dim=-1).indices
    recomputed = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, best, True)
    assert torch.allclose(logits[recomputed], reference[recomputed], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain[recomputed], reference[recomputed], rtol=1e-3, atol=1e-3)
    assert torch.equal(logits[~recomputed], plain[~recomputed])  # the rest keep the FP8 head's values
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def test_the_fp8_head_follows_the_weights_and_the_heads_shape(tmp_path, registry):
    plain = _load(registry, make_tiny_llama(tmp_path / "bf"))
    assert plain.lm_head.weight.dtype == torch.float32  # no FP8 weights: a 16-bit head, and no error
    odd = make_tiny_llama(tmp_path / "odd", vocab_size=500)  # 500 rows: not a multiple of 16
    assert _load(registry, odd, quantization="fp8").lm_head.weight.dtype == torch.float32
    assert _load(registry, odd, quantization="fp8", quantize_lm_head=True).lm_head.weight.dtype == FP8_DTYPE


def test_quantize_lm_head_needs_fp8_weights(tiny, registry):
    with pytest.raises(ModelLoadError, match="model.quantize_lm_head needs FP8 weights: set model.quantization: fp8"):
        _load(registry, tiny, quantize_lm_head=True)


def test_per_channel_fp8_checkpoint_loads_to_the_same_model_as_quantizing_at_load(tiny, tmp_path, registry):
    checkpoint = make_tiny_fp8_llama(tmp_path / "fp8")  # same seed, so the same float weights
    loaded = _load(registry, checkpoint)
    quantized = _load(registry, tiny, quantization="fp8")
    for name, param in quantized.state_dict().items():
        assert torch.equal(loaded.state_dict()[name].float(), param.float()), name
    assert torch.equal(_logits(loaded), _logits(quantized))


def test_per_tensor_scales_of_merged_projections_land_on_their_rows(tmp_path, registry):
    checkpoint = make_tiny_fp8_llama(tmp_path / "fp8t", per_tensor=True)
    stored = load_file(str(Path(checkpoint, "model.safetensors")))
    model = _load(registry, checkpoint)
    qkv = model.model.layers[1].self_attn.qkv_proj
    for shard, (offset, rows) in qkv.shards.items():
        scale = stored[f"model.layers.1.self_attn.{shard}.weight_scale"]
        assert scale.shape == ()
        assert torch.equal(qkv.weight_scale[offset:offset + rows], scale.expand(rows, 1))
        assert torch.equal(qkv.weight[offset:offset + rows].float(),
                           stored[f"model.layers.1.self_attn.{shard}.weight"].float())
    reference = _logits(_load(registry, make_tiny_llama(tmp_path / "bf")))
    assert _relative_rms_error(_logits(model), reference) < 0.15


def test_static_activation_scale_is_shared_by_merged_projections(tmp_path, registry):
    checkpoint = make_tiny_fp8_llama(tmp_path / "fp8s", input_scale=10 / 448)
    model = _load(registry, checkpoint)
    assert model.model.layers[0].mlp.gate_up_proj.input_scale.item() == pytest.approx(10 / 448)
    reference = _logits(_load(registry, make_tiny_llama(tmp_path / "bf")))
    assert _relative_rms_error(_logits(model), reference) < 0.15


def test_without_fp8_matmuls_a_checkpoint_is_dequantized_at_load(tmp_path, registry, monkeypatch):
    monkeypatch.setattr(quantization, "fp8_matmul_unsupported", lambda device: "has no FP8 here")
    checkpoint = make_tiny_fp8_llama(tmp_path / "fp8d")
    stored = load_file(str(Path(checkpoint, "model.safetensors")))
    model = _load(registry, checkpoint)
    assert not _fp8_params(model)
    down = model.model.layers[0].mlp.down_proj
    assert not hasattr(down, "weight_scale") and down.weight.dtype == torch.float32
    expected = dequantize(stored["model.layers.0.mlp.down_proj.weight"],
                          stored["model.layers.0.mlp.down_proj.weight_scale"], torch.float32)
    assert torch.equal(down.weight, expected)
    with pytest.raises(ModelLoadError, match="model.quantization: fp8 has no FP8 here"):
        _load(registry, make_tiny_llama(tmp_path / "bf"), quantization="fp8")


def test_an_engine_serves_an_fp8_model_on_the_cpu(tiny):
    from treadle.core.engine import Engine

    engine = Engine({"model": {"path": tiny, "device": "cpu", "quantization": "fp8"},
                     "cache": {"max_total_tokens": 512}})
    try:
        out = engine.generate(input_ids=[TOKENS], sampling_params={"max_new_tokens": 6, "temperature": 0,
                                                                     "ignore_eos": True})
        assert len(out[0].token_ids) == 6 and out[0].completion_tokens == 6
        assert engine.model_info["dtype"] == "float32"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mixtral"])
def test_other_families_quantize_their_projections(family, tmp_path):
    """Qwen2 (q/k/v bias), Qwen3 (qk-norm) and Mixtral (attention in FP8, fused experts kept in the model dtype)."""
    from treadle.testing import models

    registry = build_registry(plugin_modules=[f"treadle.plugins.models.{family}"], load_entry_points=False)
    path = getattr(models, f"make_tiny_{family}")(tmp_path / family)
    reference = _logits(_load(registry, path))
    model = _load(registry, path, quantization="fp8")
    attention = model.model.layers[0].self_attn
    assert attention.qkv_proj.weight.dtype == FP8_DTYPE and attention.o_proj.weight.dtype == FP8_DTYPE
    if family == "qwen2":
        assert attention.qkv_proj.bias is not None and attention.qkv_proj.bias.dtype == torch.float32
    # Random tiny models amplify rounding (0.09-0.16 measured); a wrong scale or layout gives about 1.
    assert _relative_rms_error(_logits(model), reference) < 0.3


TP_WORKER = r'''
import sys, torch
sys.path.insert(0, sys.argv[4])
from test_fp8_models import _load, _logits
from treadle.core.distributed.parallel import destroy_tensor_parallel, init_tensor_parallel
from treadle.core.registry import build_registry

rank, port, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s=60)
registry = build_registry(plugin_modules=["treadle.plugins.models.llama"], load_entry_points=False)
for name in ("static_per_tensor", "dynamic_per_channel"):
    model = _load(registry, f"{folder}/{name}", lm_head_exact_top=0)  # each rank would recompute its own best 8
    assert model.model.layers[0].mlp.down_proj.weight.shape == (64, 64)  # half of the 128 input columns
    expected = torch.load(f"{folder}/{name}.pt")
    logits = _logits(model)
    error = ((logits - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()
    print(f"{name} {error}", flush=True)
destroy_tensor_parallel()
'''


def test_fp8_checkpoints_load_and_run_under_tensor_parallelism(tmp_path, registry):
    """tp=2 over gloo on the CPU: scales follow their rows (per tensor and per channel, from lazy slices)."""
    import os
    import socket
    import subprocess
    import sys

    checkpoints = {
        "static_per_tensor": make_tiny_fp8_llama(tmp_path / "static_per_tensor", per_tensor=True, input_scale=10 / 448),
        "dynamic_per_channel": make_tiny_fp8_llama(tmp_path / "dynamic_per_channel"),
    }
    for name, path in checkpoints.items():
        torch.save(_logits(_load(registry, path, lm_head_exact_top=0)), tmp_path / f"{name}.pt")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    here = str(Path(__file__).parent)
    ranks = [subprocess.Popen([sys.executable, "-c", TP_WORKER, str(rank), str(port), str(tmp_path), here], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    for proc in ranks:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        errors = {name: float(value) for name, value in (line.split() for line in out.splitlines())}
        # A static activation scale quantizes each rank's half of x exactly as tp=1 does (2e-7 measured);
        # per-token scales of a row-parallel layer's input are taken over the rank's half, so the FP8
        # rounding differs (0.046 measured, about half of FP8's own error here; a wrong scale gives ~1).
        assert errors["static_per_tensor"] < 1e-5, out
        assert errors["dynamic_per_channel"] < 0.15, out


@pytest.mark.parametrize("per_tensor", [False, True])
def test_fp8_mixtral_checkpoint_keeps_its_experts_fp8_with_their_scales(tmp_path, per_tensor):
    import copy

    from treadle.testing.models import make_tiny_fp8_mixtral, make_tiny_mixtral

    registry = build_registry(plugin_modules=["treadle.plugins.models.mixtral"], load_entry_points=False)
    checkpoint = make_tiny_fp8_mixtral(tmp_path / "fp8", per_tensor=per_tensor, input_scale=0.05)
    stored = load_file(str(Path(checkpoint, "model.safetensors")))
    model = _load(registry, checkpoint)
    experts = model.model.layers[1].mlp.experts
    inter = experts.intermediate_size
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == FP8_DTYPE
    for e in range(experts.num_experts):
        stem = f"model.layers.1.block_sparse_moe.experts.{e}"
        for rows, part in ((slice(0, inter), "w1"), (slice(inter, None), "w3")):
            stored_weight = stored[f"{stem}.{part}.weight"]
            assert torch.equal(experts.gate_up_proj[e, rows].view(torch.uint8), stored_weight.view(torch.uint8))
            scale = stored[f"{stem}.{part}.weight_scale"].reshape(-1)
            assert torch.equal(experts.gate_up_scale[e, rows], scale.expand(inter))
        down_scale = stored[f"{stem}.w2.weight_scale"].reshape(-1)
        assert torch.equal(experts.down_scale[e], down_scale.expand(experts.hidden_size))
    # The same weights dequantized into float32 experts run the same numbers: the scales are where they belong.
    widened = copy.deepcopy(model)
    for layer in widened.model.layers:
        moe = layer.mlp.experts
        moe.gate_up_proj = torch.nn.Parameter(dequantize(moe.gate_up_proj, moe.gate_up_scale[..., None], torch.float32))
        moe.down_proj = torch.nn.Parameter(dequantize(moe.down_proj, moe.down_scale[..., None], torch.float32))
        moe.gate_up_scale = moe.down_scale = None
    logits = _logits(model)
    assert torch.equal(logits, _logits(widened))
    # Against the same model in float32: the FP8 roundings of every projection and the attention's static input
    # scale (about 0.17), not a wrong scale (of the order of 1).
    reference = _logits(_load(registry, make_tiny_mixtral(tmp_path / "f32")))
    assert 0 < _relative_rms_error(logits, reference) < 0.3


def test_fp8_expert_weight_and_scale_load_in_either_order_on_each_tensor_parallel_rank():
    from treadle.layers.moe import FusedExperts

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 4, generator=generator).to(FP8_DTYPE)  # w1 of expert 1: [intermediate, hidden]
    scale = torch.rand(6, 1, generator=generator) + 0.5
    for rank in (0, 1):
        want = dequantize(weight, scale, torch.float32)[3 * rank : 3 * rank + 3]
        for order in (("weight", "weight_scale"), ("weight_scale", "weight")):
            experts = FusedExperts(num_experts=2, hidden_size=4, intermediate_size=6, tp_rank=rank, tp_size=2)
            tensors = {"weight": weight, "weight_scale": scale}
            first, second = (experts.load_checkpoint_tensor(f"1.w1.{kind}", tensors[kind]) for kind in order)
            assert first == set() and second == {"1.w1.weight"}  # the weight counts as loaded once both are in
            assert torch.equal(experts.gate_up_proj.data[1, :3], want), (rank, order)
        assert experts.load_checkpoint_tensor("1.w1.input_scale", torch.tensor(0.1)) == set()
    with pytest.raises(Exception, match="weight_scale has shape"):
        FusedExperts(2, 4, 6).load_checkpoint_tensor("0.w2.weight_scale", torch.ones(3, 1))


def test_fp8_experts_load_as_stored_into_each_tensor_parallel_rank():
    from treadle.layers.moe import FusedExperts

    generator = torch.Generator().manual_seed(1)
    up = torch.randn(6, 4, generator=generator).to(FP8_DTYPE)  # w3 of expert 0: [intermediate, hidden]
    down = torch.randn(4, 6, generator=generator).to(FP8_DTYPE)  # w2: [hidden, intermediate]
    up_scale, down_scale = torch.rand(6, 1, generator=generator), torch.tensor(0.25)
    for rank in (0, 1):
        experts = FusedExperts(num_experts=1, hidden_size=4, intermediate_size=6, tp_rank=rank, tp_size=2, fp8=True)
        rows = slice(3 * rank, 3 * rank + 3)
        assert experts.load_checkpoint_tensor("0.w3.weight", up) == {"0.w3.weight"}
        assert experts.load_checkpoint_tensor("0.w3.weight_scale", up_scale) == {"0.w3.weight_scale"}
        assert experts.load_checkpoint_tensor("0.w2.weight", down) == {"0.w2.weight"}
        assert experts.load_checkpoint_tensor("0.w2.weight_scale", down_scale) == {"0.w2.weight_scale"}
        assert experts.gate_up_proj.dtype == FP8_DTYPE
        assert torch.equal(experts.gate_up_proj[0, 3:].view(torch.uint8), up[rows].view(torch.uint8))
        assert torch.equal(experts.gate_up_scale[0, 3:], up_scale[rows, 0])
        assert torch.equal(experts.down_proj[0].view(torch.uint8), down[:, rows].view(torch.uint8))
        assert torch.equal(experts.down_scale[0], down_scale.expand(4))
        assert "0.w1.weight_scale" in experts.checkpoint_names()  # a missing scale is a missing tensor
    with pytest.raises(Exception, match="FP8 checkpoint's experts are stored as"):
        FusedExperts(1, 4, 6, fp8=True).load_checkpoint_tensor("0.w1.weight", torch.ones(6, 4))


def test_quantize_at_load_makes_the_experts_fp8_with_a_scale_per_row(tmp_path):
    from treadle.kernels.fp8_ops import quantize_per_channel
    from treadle.testing.models import make_tiny_mixtral

    registry = build_registry(plugin_modules=["treadle.plugins.models.mixtral"], load_entry_points=False)
    path = make_tiny_mixtral(tmp_path / "f32")
    reference_model = _load(registry, path)
    model = _load(registry, path, quantization="fp8")
    for layer, original in zip(model.model.layers, reference_model.model.layers):
        experts, widened = layer.mlp.experts, original.mlp.experts
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == FP8_DTYPE
        for e in range(experts.num_experts):
            q, scale = quantize_per_channel(widened.gate_up_proj[e])
            assert torch.equal(experts.gate_up_proj[e].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(experts.gate_up_scale[e], scale.reshape(-1))
            q, scale = quantize_per_channel(widened.down_proj[e])
            assert torch.equal(experts.down_proj[e].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(experts.down_scale[e], scale.reshape(-1))
    # The FP8 roundings of every projection (about 0.16 on this tiny MoE), not a wrong scale (of the order of 1).
    assert 0 < _relative_rms_error(_logits(model), _logits(reference_model)) < 0.3
