"""Integer MoE experts kept packed (layers/int_experts.py): a tensor-parallel rank's packed experts are its slice
of the whole model's (gate/up rows, down's columns in whole groups)."""

from __future__ import annotations

import torch

from treadle.core.config import ModelConfig
from treadle.core.distributed import parallel
from treadle.core.loading.model_loader import load_model
from treadle.core.registry import build_registry
from treadle.layers.int_experts import dequantize_expert
from treadle.testing.models import make_tiny_mixtral
from treadle.testing.quantized_models import make_tiny_quantized


def _experts(folder: str, registry) -> dict[str, torch.Tensor]:
    model, _, _ = load_model(ModelConfig(path=folder, device="cpu", dtype="float32"), registry)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.int32
    bits, group, panels = experts.int_scheme.bits, experts.int_group, experts.panels
    return {name: torch.stack([dequantize_expert(
        getattr(experts, f"{name}_proj")[e], getattr(experts, f"{name}_scales")[e],
        None if getattr(experts, f"{name}_zeros") is None else getattr(experts, f"{name}_zeros")[e], bits, group,
        panels, torch.float32) for e in range(experts.num_experts)]) for name in ("gate_up", "down")}


def test_a_rank_holds_its_slice_of_the_packed_experts(tmp_path, monkeypatch):
    registry = build_registry(plugin_modules=["treadle.plugins.models.mixtral", "treadle.plugins.quantization.gptq"],
                              load_entry_points=False)
    # Groups of 16, so each rank's 48 intermediate columns are whole groups; zero points too.
    quantized, _ = make_tiny_quantized(tmp_path, "gptq", make_tiny_mixtral, group_size=16, sym=False)
    whole = _experts(quantized, registry)
    monkeypatch.setattr(parallel, "_group", parallel.TensorParallelGroup(rank=1, size=2))
    rank = _experts(quantized, registry)
    inter = whole["down"].shape[2]
    local = inter // 2  # rank 1: the second half of the intermediate size
    gate, up = whole["gate_up"][:, :inter], whole["gate_up"][:, inter:]
    assert torch.equal(rank["gate_up"], torch.cat([gate[:, local:], up[:, local:]], dim=1))
    assert torch.equal(rank["down"], whole["down"][:, :, local:])


def test_moe_layers_share_one_dequant_scratch_sized_for_half_of_gate_up(monkeypatch):
    # What a GPU load does (the scratch exists only where the Triton kernels run, so use_triton is forced here).
    from types import SimpleNamespace

    from treadle.layers import int_experts

    monkeypatch.setattr(int_experts, "use_triton", lambda tensor: True)

    def layer(num_experts=4, local=256, hidden=128, dtype=torch.bfloat16):
        return SimpleNamespace(gate_up_proj=torch.zeros(num_experts, 2 * local, hidden // 8, dtype=torch.int32),
                               gate_up_scales=torch.ones(1, dtype=dtype), panels=True, num_experts=num_experts,
                               local_size=local, hidden_size=hidden)

    first, second = layer(), layer()
    int_experts.reserve_dequant_scratch(first)
    int_experts.reserve_dequant_scratch(second)
    assert first.dequant_scratch is second.dequant_scratch
    assert first.dequant_scratch.numel() == 4 * 256 * 128 and first.dequant_scratch.dtype == torch.bfloat16
    monkeypatch.setenv("TREADLE_INT_MOE_DEQUANT_ROWS", "0")  # the dequant form off: no scratch
    off = layer()
    int_experts.reserve_dequant_scratch(off)
    assert off.dequant_scratch is None
