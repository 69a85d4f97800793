"""Qwen3-MoE, registered as ``Qwen3MoeForCausalLM``: Qwen3's attention (per-head q/k norm) with a sparse
mixture of experts on every ``decoder_sparse_step``-th layer outside ``mlp_only_layers`` (dense MLPs there)."""

from __future__ import annotations

from typing import Any

from torch import nn

from treadle.core.hookspecs import Register, hookimpl
from treadle.layers.decoder import DecoderLayer, layer_sliding_window
from treadle.plugins.models.llama import LlamaForCausalLM
from treadle.layers.moe import sparse_moe_from_config


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE causal LM (e.g. Qwen3-30B-A3B); the router's top-k weights are renormalised per ``norm_topk_prob``."""

    # ~3B active parameters a token across 48 layers of router, sort and expert kernels: an eager prefill of
    # 2-4k tokens took as long to launch as to run on an H100, so its prefill graphs cover whole chunks
    # (runtime.piecewise_cuda_graph_max_tokens: auto; docs/scheduling.md, "Prefill CUDA graphs").
    launch_bound_prefill = True
    # A decode batch of a few hundred tokens reads every expert, as a prefill chunk does: a prefill chunk riding in
    # a decode step saves one read of the experts (~20 ms in bf16 on an H100). Offline, 1000 requests: 1.17x
    # (scheduler.enable_mixed_chunk: auto; docs/scheduling.md, "Mixed chunks for a mixture of experts").
    prefers_mixed_chunks = True

    def make_layer(self, config: Any, layer_id: int) -> nn.Module:
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        sparse = layer_id not in (getattr(config, "mlp_only_layers", None) or []) and (layer_id + 1) % step == 0
        return DecoderLayer(config, layer_id, layer_sliding_window(config, layer_id), quant_config=self.quant_config,
                            qk_norm=True, mlp=sparse_moe_from_config(config, self.quant_config) if sparse else None)


@hookimpl
def treadle_register_models(register: Register) -> None:
    register("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM)
